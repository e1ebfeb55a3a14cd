"""The per-iteration training line, field for field as Megatron-LM core_v0.16.1's loop prints it.

Megatron-LM's fields come first, in its order, names and number formats, each closed by " |":
iteration, consumed samples, elapsed time per iteration (ms), throughput per GPU
(TFLOP/s/GPU) (with --log-throughput), learning rate, global batch size, the losses (lm loss,
then the MoE auxiliary losses megatron-core's ``track_moe_metrics`` collected, each printed
when above zero), loss scale, grad norm, num zeros (--log-num-zeros-in-grad), params norm
(--log-params-norm), number of skipped iterations, number of nan iterations. This driver's own
fields follow them, in the same "name: value |" form: the phase times (--timing-log-level),
tokens/s, the per-layer auxiliary losses (--moe-per-layer-logging), memory and progress.

As in Megatron-LM, the losses, the iteration time and the phase times are averages over the
iterations since the last logged one, and the skipped and nan counts are that interval's.
"""

import datetime
from typing import Dict, List

# Megatron-LM's fields of the line, in its order ("<losses>": lm loss and the MoE auxiliary
# losses). tests/unit/test_iteration_log.py compares this list with Megatron-LM's own function.
MEGATRON_LM_FIELDS = (
    "iteration", "consumed samples", "elapsed time per iteration (ms)", "throughput per GPU (TFLOP/s/GPU)",
    "learning rate", "global batch size", "<losses>", "loss scale", "grad norm", "num zeros", "params norm",
    "number of skipped iterations", "number of nan iterations",
)

# The names megatron-core's routers save their auxiliary losses under, as Megatron-LM logs them.
AUX_LOSS_NAMES = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss", "z_loss")

# Metrics of the line that are counts for the interval, not TensorBoard scalars.
INTERVAL_COUNTS = ("skipped-iterations", "nan-iterations")


def aux_loss_names(args) -> List[str]:
    """The auxiliary losses Megatron-LM's loop tracks for ``args`` (its rule: a name for each
    load-balancing type whose name contains the key, the z-loss when its coefficient is set)."""
    if not getattr(args, "num_experts", None):
        return []
    types = args.moe_router_load_balancing_type
    types = [types] if isinstance(types, str) else list(types)
    names = [name for key, name in (("aux_loss", "load_balancing_loss"), ("seq_aux_loss", "seq_load_balancing_loss"),
                                    ("global_aux_loss", "global_load_balancing_loss"))
             if any(key in kind for kind in types)]
    if getattr(args, "moe_z_loss_coeff", None) is not None:
        names.append("z_loss")
    return names


def is_per_layer(name: str) -> bool:
    """A per-layer auxiliary loss under megatron-core's TensorBoard name ("moe/z_loss_layer_0")."""
    return name.startswith("moe/") and "_layer_" in name


class PerLayerRecorder:
    """What megatron-core's ``track_moe_metrics`` gives a writer, kept: with per-layer logging it
    hands each layer's auxiliary loss to ``add_scalar`` as ``moe/<name>_layer_<i>``."""

    def __init__(self):
        self.values: Dict[str, float] = {}

    def add_scalar(self, name, value, iteration) -> None:
        if is_per_layer(name):
            self.values[name] = float(value)


class IntervalTotals:
    """Megatron-LM's sums between two logged iterations: the losses of the iterations that
    updated the model, the times of all, the skipped iterations and those of them whose loss
    was not finite."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.losses: Dict[str, object] = {}
        self.times: Dict[str, float] = {}
        self.advanced = self.skipped = self.nan = self.iterations = 0

    def add(self, losses: Dict[str, object], times: Dict[str, float], skipped: bool) -> None:
        """One iteration: ``losses`` by name (numbers or one-element tensors, summed without a
        host sync), ``times`` in seconds by phase."""
        self.iterations += 1
        for phase, seconds in times.items():
            self.times[phase] = self.times.get(phase, 0.0) + seconds
        if skipped:
            self.skipped += 1
            self.nan += int(any(not _finite(value) for value in losses.values()))
            return
        self.advanced += 1
        for name, value in losses.items():
            self.losses[name] = self.losses[name] + value if name in self.losses else value

    def averages(self) -> Dict[str, Dict[str, float]]:
        """{"losses": per advanced iteration, "times": per iteration}; then starts a new interval."""
        losses = {name: _float(total) / max(1, self.advanced) for name, total in self.losses.items()}
        times = {phase: total / max(1, self.iterations) for phase, total in self.times.items()}
        counts = {"skipped-iterations": self.skipped, "nan-iterations": self.nan}
        self.reset()
        return {"losses": losses, "times": times, "counts": counts}


def _float(value) -> float:
    return float(value.item()) if hasattr(value, "item") else float(value)


def _finite(value) -> bool:
    number = _float(value)
    return number == number and abs(number) != float("inf")


def _field(name: str, value: str) -> str:
    return f" {name}: {value} |"


def megatron_lm_part(args, iteration: int, metrics: dict) -> str:
    """Megatron-LM's fields (see the module's docstring), each closed by " |"."""
    parts = [f" [{datetime.datetime.now():%Y-%m-%d %H:%M:%S.%f}]",
             f" iteration {iteration:8d}/{args.train_iters:8d} |",
             _field("consumed samples", f"{metrics['consumed-samples']:12d}"),
             _field("elapsed time per iteration (ms)", f"{metrics['iteration-time'] * 1000:.1f}")]
    if "throughput" in metrics:
        parts.append(_field("throughput per GPU (TFLOP/s/GPU)", f"{metrics['throughput']:.1f}"))
    parts += [_field("learning rate", f"{metrics['learning-rate']:.6E}"),
              _field("global batch size", f"{metrics['batch-size']:5d}"),
              _field("lm loss", f"{metrics['lm loss']:.6E}")]
    parts += [_field(name, f"{value:.6E}") for name, value in metrics.items() if name in AUX_LOSS_NAMES and value > 0.0]
    parts.append(_field("loss scale", f"{metrics.get('loss-scale', 1.0):.1f}"))
    parts.append(_field("grad norm", f"{metrics['grad-norm']:.3f}"))
    if "num-zeros" in metrics:
        parts.append(_field("num zeros", f"{metrics['num-zeros']:.0f}"))
    if "params-norm" in metrics:
        parts.append(_field("params norm", f"{metrics['params-norm']:.3f}"))
    parts.append(_field("number of skipped iterations", f"{metrics.get('skipped-iterations', 0):3d}"))
    parts.append(_field("number of nan iterations", f"{metrics.get('nan-iterations', 0):3d}"))
    return "".join(parts)


def extras_part(args, iteration: int, metrics: dict, started: float, now: float) -> str:
    """This driver's fields after Megatron-LM's: phase times, tokens/s, per-layer auxiliary
    losses, memory (allocated/peak) and progress with the time left."""
    phases = [_field(f"{name[:-len('-time')]} (ms)", f"{value * 1000:.1f}")
              for name, value in metrics.items() if name.endswith("-time") and name != "iteration-time"]
    tokens = [_field("tokens/s", f"{metrics['tokens-per-sec']:.0f}")] if "tokens-per-sec" in metrics else []
    layers = [_field(name, f"{value:.6E}") for name, value in metrics.items() if is_per_layer(name)]
    done = iteration / args.train_iters
    eta = (now - started) / max(done, 1e-9) * (1 - done)
    memory = f"{metrics['mem-allocated-bytes'] / 2**20:.0f}/{metrics['mem-max-allocated-bytes'] / 2**20:.0f}"
    tail = [_field("mem (MiB)", memory),
            _field("progress", f"{100 * done:5.1f}% eta {datetime.timedelta(seconds=int(eta))}")]
    return "".join(phases + tokens + layers + tail)


def log_line(args, iteration: int, metrics: dict, started: float, now: float) -> str:
    """The whole line: Megatron-LM's fields, then this driver's."""
    return megatron_lm_part(args, iteration, metrics) + extras_part(args, iteration, metrics, started, now)


def field_names(line: str) -> List[str]:
    """The names of a line's fields in order ("iteration", "consumed samples", ...)."""
    names = []
    for part in line.split(" |"):
        part = part.strip()
        if part.startswith("["):  # the time stamp, then "iteration N/M"
            part = part.split("]", 1)[1].strip()
        if not part:
            continue
        names.append(part.split(":", 1)[0] if ":" in part else part.split()[0])
    return names


def tensorboard_metrics(metrics: dict) -> dict:
    """The metrics TensorBoard gets (the interval counts are the line's only)."""
    return {name: value for name, value in metrics.items() if name not in INTERVAL_COUNTS}
