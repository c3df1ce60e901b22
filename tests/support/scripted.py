"""Scripted replies for the write side's step generators (``mongo_outbox/_steps.py``), so the
rules they hold can be tested without a database.

A step generator yields each database call it needs and receives the reply back, or has the
exception thrown in at the ``yield``. ``play`` drives one from a script: each turn names the call
the steps must make (its target's name, the method, the arguments) and the reply to give it (or
the exception to throw in; a turn whose method is ``ANY`` takes whichever call comes). A call
other than the script's next, a call past the script's end, or turns left over when the steps
return, fail the test.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from mongo_outbox._steps import Steps

T = TypeVar("T")

ANY = "*"
"""A turn's ``method`` that takes whichever call comes (for a reply that does not depend on it)."""


@dataclass(frozen=True)
class Turn:
    """One call the steps must make, and what it answers (``raises``: thrown in instead)."""

    method: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    reply: Any = None
    raises: Exception | None = None
    target: str | None = None
    """The name of the collection called (None: any)."""


def play(steps: Steps[T], *turns: Turn) -> T:
    """Drive ``steps`` through ``turns``, asserting every call; the steps' result."""
    script = list(turns)
    reply: Any = None
    failure: Exception | None = None
    made = 0
    while True:
        try:
            step = steps.send(reply) if failure is None else steps.throw(failure)
        except StopIteration as done:
            assert not script, (
                f"the steps returned after {made} calls; the script expected {script}"
            )
            result: T = done.value
            return result
        made += 1
        assert script, f"call {made} is past the script's end: {step.method}{step.args}"
        turn = script.pop(0)
        if turn.method != ANY:
            assert (step.method, step.args, dict(step.kwargs)) == (
                turn.method,
                turn.args,
                dict(turn.kwargs),
            ), f"call {made}"
        if turn.target is not None:
            assert step.target.name == turn.target, f"call {made}"
        reply, failure = turn.reply, turn.raises
