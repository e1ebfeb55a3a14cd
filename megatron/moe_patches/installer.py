"""apply() / revert() / status(): install the series into the imported megatron-core.

What a feature installs is a short list of named bindings (``registry.Binding``): one
attribute of one megatron-core module or class, set to this package's object, each with the
reason megatron-core offers no seam there. Experts reach megatron-core through its layer spec
(the spec provider's experts classes), configs through the config classes' public names.
Nothing else is rebound. Installing sets each binding and keeps what was there; reverting puts
it back, also in an optional owner module (Megatron-LM's) imported while the patch was on.
Applying twice is applying once. A feature whose code calls or overrides a megatron-core method
by name (``Feature.relies_on``) is skipped, with a warning naming it, where that method is
missing: an override of a renamed method would otherwise silently stop applying.
"""

import importlib
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Union

from megatron.moe_patches import capabilities as cap
from megatron.moe_patches.fields import shown
from megatron.moe_patches.registry import SERIES, Binding, Feature, get

logger = logging.getLogger(__name__)


@dataclass
class _Installed:
    binding: Binding
    stock: object
    patched: object


_ABSENT = object()  # the stock value of a binding whose name megatron-core leaves undefined

# feature id -> its installed bindings, in install order
_applied: Dict[str, List[_Installed]] = {}


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


def _resolve(path: str):
    """``"pkg.module"`` or ``"pkg.module:Class.attr"`` -> the object."""
    module_name, _, qualname = path.partition(":")
    obj = importlib.import_module(module_name)
    for part in qualname.split(".") if qualname else ():
        obj = getattr(obj, part)
    return obj


def _owner(binding: Binding):
    """The module or class a binding sets an attribute of, or None for an optional owner
    (a Megatron-LM module) that is not imported: importing it later reads the bound name from
    megatron-core's module."""
    module_name = binding.owner.partition(":")[0]
    if binding.optional and module_name not in sys.modules:
        return None
    return _resolve(binding.owner)


def _install(binding: Binding) -> _Installed:
    """Set ``binding``; an optional owner not imported yet is recorded with no stock object
    (revert() finds what it imported meanwhile through the other records)."""
    owner = _owner(binding)
    if owner is None:
        return _Installed(binding, None, None)
    if binding.absent_in_stock:
        if binding.attribute in vars(owner):
            raise RuntimeError(f"{binding.owner}.{binding.attribute} exists, but the registry says megatron-core "
                               "defines it only where the feature is native (which the feature's probe denies)")
        stock = _ABSENT
    else:
        stock = owner.__dict__[binding.attribute] if isinstance(owner, type) else getattr(owner, binding.attribute)
    patched = _resolve(binding.patched)
    if binding.factory:
        patched = patched(owner, stock)
        if patched is stock:  # nothing to patch here (a TE class megatron-core defines only with TE)
            return _Installed(binding, None, None)
    setattr(owner, binding.attribute, patched)
    cap.note_installed(stock, patched)
    return _Installed(binding, stock, patched)


def _uninstall(installed: _Installed, stock_of: Dict[int, object]) -> None:
    """Put the stock object back. ``stock_of``: id(patched) -> stock over the feature's
    records, for an optional owner imported while the patch was on (it copied the patched
    object from megatron-core's module)."""
    owner = _owner(installed.binding)
    if owner is None:
        return
    current = getattr(owner, installed.binding.attribute, None)
    stock = installed.stock if current is installed.patched and installed.patched is not None else stock_of.get(id(current))
    if stock is _ABSENT:
        delattr(owner, installed.binding.attribute)
    elif stock is not None:
        setattr(owner, installed.binding.attribute, stock)
    if installed.patched is not None:
        cap.note_reverted(installed.patched)


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
    if isinstance(features, Mapping):  # iterating {"F4": False} would give "F4": its value ignored
        raise TypeError(f"features: got {type(features).__name__} {shown(repr(features))}; a mapping is not taken "
                        f"(its keys would be selected whatever their values say): pass {FEATURES_ACCEPTED} "
                        f"(the series: {_series_ids()})")
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
    absent = [path for path in feature.relies_on if not _resolvable(path)]
    if absent:
        return FeatureStatus(
            feature.id, feature.title, "skipped",
            f"megatron-core {version} has no {', '.join(absent)}, which it calls or overrides", te_ok
        )
    return None


def _resolvable(path: str) -> bool:
    try:
        _resolve(path)
    except (ImportError, AttributeError):
        return False
    return True


def _apply_one(feature: Feature) -> None:
    for dep in feature.requires:
        if dep not in _applied:
            _apply_one(get(dep))
    blocked = _why_not(feature)
    if blocked is not None:
        # Skipped for a missing megatron-core method is a surprise worth a warning.
        level = logging.WARNING if "which it calls or overrides" in blocked.reason else logging.INFO
        logger.log(level, "moe_patches: %s", blocked.line())
        return
    installed = [_install(binding) for binding in feature.bindings]
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
            records = _applied.pop(feature_id)
            stock_of = {id(r.patched): r.stock for r in records if r.patched is not None}
            for record in reversed(records):
                _uninstall(record, stock_of)
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


__all__ = ["apply", "revert", "status", "is_applied", "installs", "FeatureStatus"]
