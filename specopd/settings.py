"""What every recipe section is made of: a field with its resume policy (``setting``), the error a bad value raises
(``RecipeError``) and the range / choice checks the sections run on their own fields.

A leaf (imports only ``specopd.errors``), so each component's section can sit beside its code and the recipe root
(``specopd.config``) can import them all. Recipes and resume policies: specopd/DESIGN.md ("Recipes").
"""
from __future__ import annotations

import dataclasses

from specopd.errors import UserError, is_finite_number

# what a resume does when a field's value differs from the checkpoint's recipe
REFUSE = "refuse"  # another run (target, drafter shape, data, seed, method): the resume is refused
FROM_HERE = "from_here"  # takes effect from the resumed step on: listed, the run differs from an uninterrupted one
SAME_RUN = "same_run"  # bookkeeping or placement, the numbers do not change: listed
RESUME_POLICIES = (REFUSE, FROM_HERE, SAME_RUN)


class RecipeError(UserError, ValueError):
    """A recipe or override is invalid; the message names the key and the fix."""


def setting(default=dataclasses.MISSING, *, resume: str, factory=dataclasses.MISSING):
    """A recipe field with its default (or ``factory`` for a list / dict) and its resume policy
    (``RESUME_POLICIES``), kept in the field's metadata under "resume"."""
    if resume not in RESUME_POLICIES:
        raise ValueError(f"resume={resume!r}: choose one of {list(RESUME_POLICIES)}")
    return dataclasses.field(default=default, default_factory=factory, metadata={"resume": resume})


def check_choice(section: str, key: str, value, choices) -> None:
    """RecipeError naming ``section.key`` and the choices unless ``value`` is one of them.

    Args:
        section, key: the recipe key, named in the message.
        value: its value.
        choices: the values it may take.
    """
    if value not in choices:
        raise RecipeError(f"{section}.{key}={value!r} is not valid; choose one of {list(choices)}")


def check_range(section: str, key: str, value, lo=None, hi=None, lo_open=False) -> None:
    """RecipeError naming ``section.key`` unless ``value`` is a finite number within the bounds.

    Args:
        section, key: the recipe key, named in the message.
        value: its value.
        lo, hi: the bounds (None: unbounded on that side), inclusive unless ``lo_open`` (then value > lo).
        lo_open: exclude ``lo`` itself.
    """
    if not is_finite_number(value):
        raise RecipeError(f"{section}.{key}={value!r} is not a finite number; give a number (NaN and inf are "
                          f"refused)")
    bad = (lo is not None and (value <= lo if lo_open else value < lo)) or (hi is not None and value > hi)
    if bad:
        lo_s = "" if lo is None else (f"> {lo}" if lo_open else f">= {lo}")
        hi_s = "" if hi is None else f"<= {hi}"
        raise RecipeError(f"{section}.{key}={value!r} is out of range; it must be {' and '.join(s for s in (lo_s, hi_s) if s)}")
