"""The recipes shipped inside the package (``megatron/moe_patches/recipes/*.yaml``).

``--yaml-cfg`` takes a path or the name of one of these: ``--yaml-cfg tiny-moe``.
A value naming an existing file is always that file; otherwise a bare name (with or
without ``.yaml``) picks the built-in recipe, a directory is an error that says so, and
anything else is an error that lists the built-in names.
"""

import os
from importlib import resources
from typing import Dict

from megatron.moe_patches.fields import shown

_PACKAGE = "megatron.moe_patches"
_FOLDER = "recipes"
SUFFIX = ".yaml"


class UnknownRecipe(FileNotFoundError):
    """A ``--yaml-cfg`` value that is neither a file nor a built-in recipe's name.

    An OSError, like any missing recipe file, so callers that report a recipe they
    cannot open report this one too. (Not a ``recipes.RecipeError``: ``recipes``
    imports this module, and this module imports only the leaf ``fields``.)
    """


def builtin_recipes() -> Dict[str, str]:
    """{name: file path} of the recipes shipped with the package, sorted by name."""
    folder = resources.files(_PACKAGE) / _FOLDER
    if not folder.is_dir():
        return {}
    found = {
        entry.name[: -len(SUFFIX)]: str(entry)
        for entry in folder.iterdir()
        if entry.is_file() and entry.name.endswith(SUFFIX)
    }
    return dict(sorted(found.items()))


def recipe_path(name: str) -> str:
    """The file of the built-in recipe ``name`` (``tiny-moe`` or ``tiny-moe.yaml``)."""
    recipes = builtin_recipes()
    stem = name[: -len(SUFFIX)] if name.endswith(SUFFIX) else name
    if stem not in recipes:
        raise UnknownRecipe(f"no built-in recipe '{name}'; the built-in recipes are {', '.join(recipes)}")
    return recipes[stem]


def resolve(value: str) -> str:
    """The file a ``--yaml-cfg`` value means: the path itself, else a built-in recipe."""
    if os.path.isfile(value):
        return value
    recipes = builtin_recipes()
    is_bare_name = os.path.basename(value) == value
    stem = os.path.basename(value)
    stem = stem[: -len(SUFFIX)] if stem.endswith(SUFFIX) else stem
    if is_bare_name and stem in recipes:
        return recipes[stem]
    if os.path.lexists(value) and not os.path.isdir(value):  # a pipe, a device, a symlink loop or to nothing
        what = ("a symbolic link that leads to no file" if os.path.islink(value) and not os.path.exists(value)
                else "not a regular file (a pipe, a device or a socket)")
        raise UnknownRecipe(f"--yaml-cfg {shown(value)}: {what}; give the path of a recipe file or a built-in "
                            f"recipe's name ({', '.join(recipes)})")
    if os.path.isdir(value):
        raise IsADirectoryError(f"--yaml-cfg {shown(value)}: a directory, not a recipe file; give the path of a "
                                f"recipe file or a built-in recipe's name ({', '.join(recipes)})")
    hint = f" (the recipes ship with the package now: --yaml-cfg {stem})" if stem in recipes else ""
    raise UnknownRecipe(
        f"--yaml-cfg {shown(value)}: no such file and no built-in recipe of that name{hint}; "
        f"the built-in recipes are {', '.join(recipes)}"
    )
