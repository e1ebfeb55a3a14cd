"""apply() / revert() / status(): install the series into the imported megatron-core.

A patch is a list of (stock object, patched object) pairs. Installing one
rebinds every module-level name in ``megatron.*`` that refers to the stock
object (``from x import f`` copies the reference, so patching the defining
module alone misses those), and reverting rebinds the patched object back,
including in modules imported while the patch was on. Identity decides
everything, so applying twice is applying once. A method has no module-level
name: it comes as a (class, attribute, patched) triple, set on the class and
restored on revert.
"""

import importlib
import logging
import sys
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

from megatron.moe_patches import capabilities as cap
from megatron.moe_patches.fields import shown
from megatron.moe_patches.registry import SERIES, Feature, get

logger = logging.getLogger(__name__)

_OWN_PACKAGE = __name__.rpartition(".")[0]

# feature id -> what it installed: (stock, patched) pairs and (class, attribute, stock, patched)
_applied: Dict[str, List[Tuple[object, object]]] = {}


@dataclass(frozen=True)
class FeatureStatus:
    id: str
    title: str
    state: str  # applied | native | skipped | off
    reason: str
    te_ok: Optional[bool]  # None: the feature needs nothing from TE

    def line(self) -> str:
        te = {None: "-", True: "ok", False: "missing"}[self.te_ok]
        return f"{self.id:3} {self.state:8} TE:{te:8} {self.title} — {self.reason}"


def rebind_everywhere(old: object, new: object) -> int:
    """Point every ``megatron.*`` module-level name bound to ``old`` at ``new``.

    This package's own modules are left alone: they hold the stock objects on purpose.
    Returns the number of names rebound.
    """
    count = 0
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith("megatron."):
            continue
        if module_name == _OWN_PACKAGE or module_name.startswith(_OWN_PACKAGE + "."):
            continue
        namespace = getattr(module, "__dict__", {})
        for name, value in list(namespace.items()):
            if value is old:
                setattr(module, name, new)
                count += 1
    return count


# What apply()/revert() take as ``features``, for their refusals.
FEATURES_ACCEPTED = ("None (the whole series), a feature id such as 'F4', ids joined by commas ('C0,F4') "
                     "or a list of ids")


class UnknownFeature(KeyError, ValueError):
    """An id in ``features`` that the series does not have: a bad value of the argument, and
    a KeyError as registry.get raises."""

    def __str__(self) -> str:
        return str(self.args[0])  # KeyError's own would print the message quoted


def _series_ids() -> str:
    return ", ".join(feature.id for feature in SERIES)


def _feature_items(features) -> Iterable:
    """The entries of ``features``; a TypeError naming the argument where it is neither a
    str nor an iterable of entries (an int; bytes, which iterate as ints)."""
    if isinstance(features, str):  # iterating "F4" would give "F" and "4"
        return features.split(",")
    if not isinstance(features, (bytes, bytearray)):
        try:
            return iter(features)
        except TypeError:
            pass
    raise TypeError(f"features: got {type(features).__name__} {shown(repr(features))}; expected {FEATURES_ACCEPTED} "
                    f"(the series: {_series_ids()})")


def _ids(features: Union[str, Iterable[str]]) -> set:
    """Feature ids from "F4", "F1,F4" or an iterable of ids. An entry that is not a str is a
    TypeError, an unknown id an UnknownFeature (a ValueError and a KeyError); both name the
    ``features`` argument."""
    ids = set()
    for position, item in enumerate(_feature_items(features)):
        if not isinstance(item, str):
            raise TypeError(f"features[{position}]: got {type(item).__name__} {shown(repr(item))}; expected a "
                            f"feature id string (the series: {_series_ids()})")
        try:
            ids.add(get(item.strip()).id)
        except KeyError as err:
            raise UnknownFeature(f"features: {err.args[0]}") from None
    return ids


def _selected(features: Optional[Union[str, Iterable[str]]]) -> List[Feature]:
    if features is None:
        return list(SERIES)
    wanted = _ids(features)
    return [feature for feature in SERIES if feature.id in wanted]


def _te_ok(feature: Feature) -> Optional[bool]:
    return None if feature.te_probe is None else bool(feature.te_probe())


def _why_not(feature: Feature) -> Optional[FeatureStatus]:
    """The status of a feature that apply() must not install, or None if it may."""
    te_ok = _te_ok(feature)
    version = cap.mcore_version()
    if feature.native():
        return FeatureStatus(
            feature.id, feature.title, "native", f"megatron-core {version} has it", te_ok
        )
    if not cap.mcore_supported(version):
        low, high = cap.SUPPORTED_MCORE
        return FeatureStatus(
            feature.id,
            feature.title,
            "skipped",
            f"megatron-core {version} is outside the tested range [{low}, {high})",
            te_ok,
        )
    missing = [dep for dep in feature.requires if dep not in _applied and not get(dep).native()]
    if missing:
        return FeatureStatus(
            feature.id, feature.title, "skipped", f"needs {', '.join(missing)} applied", te_ok
        )
    return None


def _apply_one(feature: Feature) -> None:
    for dep in feature.requires:
        if dep not in _applied:
            _apply_one(get(dep))
    blocked = _why_not(feature)
    if blocked is not None:
        logger.info("moe_patches: %s", blocked.line())
        return
    patches = [patch for module in feature.installs for patch in importlib.import_module(module).replacements()]
    installed = []
    for patch in patches:
        if len(patch) == 3:  # (class, attribute, patched): keep what the class itself had
            owner, name, new = patch
            old = owner.__dict__[name]
            setattr(owner, name, new)
            installed.append((owner, name, old, new))
            continue
        old, new = patch
        rebind_everywhere(old, new)
        cap.note_installed(old, new)
        installed.append(patch)
    _applied[feature.id] = installed
    logger.info("moe_patches: applied %s (%s)", feature.id, feature.title)


def apply(features: Optional[Union[str, Sequence[str]]] = None) -> List[FeatureStatus]:
    """Install the selected features (default: the whole series), prerequisites first.

    Features megatron-core already has natively and those that cannot run here are
    skipped with a logged reason. Safe to call any number of times.
    """
    for feature in _selected(features):
        if feature.id not in _applied:
            _apply_one(feature)
    return status()


def revert(features: Optional[Union[str, Sequence[str]]] = None) -> None:
    """Undo apply() for the selected features (default: all), last applied first.

    Reverting a feature also reverts every applied feature that requires it.
    """
    if features is None:
        targets = set(_applied)
    else:
        targets = _ids(features)
        grew = True
        while grew:  # dependents of dependents go too
            dependents = {f.id for f in SERIES if set(f.requires) & targets} - targets
            targets |= dependents
            grew = bool(dependents)
    for feature_id in reversed(list(_applied)):
        if feature_id in targets:
            for patch in reversed(_applied.pop(feature_id)):
                if len(patch) == 4:
                    owner, name, old, _ = patch
                    setattr(owner, name, old)
                    continue
                old, new = patch
                rebind_everywhere(new, old)
                cap.note_reverted(new)
            logger.info("moe_patches: reverted %s", feature_id)


def is_applied(feature_id: str) -> bool:
    return get(feature_id).id in _applied


def installs(feature_id: str) -> bool:
    """Whether ``apply()`` installs this feature into the imported megatron-core (or already
    did): False where megatron-core has it natively, where it is outside the tested range,
    or where a prerequisite neither installs nor is native. Asks no question of the process
    state besides what is applied, so it answers the same before and after ``apply()``."""
    feature = get(feature_id)
    if feature.id in _applied:
        return True
    if feature.native() or not cap.mcore_supported():
        return False
    return all(get(dep).native() or installs(dep) for dep in feature.requires)


def status() -> List[FeatureStatus]:
    """One row per series entry: applied, native, skipped (with why) or off."""
    rows = []
    for feature in SERIES:
        if feature.id in _applied:
            rows.append(FeatureStatus(feature.id, feature.title, "applied", "installed", _te_ok(feature)))
            continue
        blocked = _why_not(feature)
        if blocked is None:
            blocked = FeatureStatus(
                feature.id, feature.title, "off", "available; call apply()", _te_ok(feature)
            )
        rows.append(blocked)
    return rows


__all__ = ["apply", "revert", "status", "is_applied", "installs", "rebind_everywhere", "FeatureStatus"]
