"""Chunk activity: what one client's chunks do as it happens (brought for a use, moved, stepped
by the optimizer), for whoever listens.

Owns the channel the mover reports its brings and moves to and the optimizer its steps of
chunks: the access clock (the brings so far; a chunk's ``last_use`` is the clock at its last
bring), and the listeners that joined it, each from its own constructor. It exists before
the mover (which takes it in its constructor) and before its listeners (which take it in
theirs: the memory tracer, the event recorder).

Does not own what a listener does with what it hears (memory/tracer.py records a warm-up's
accesses, memory/events.py logs timed events), nor the brings and moves themselves
(memory/mover.py).

[Note: a listener hears by its own state]
Who hears what changes while training runs: the tracer hears the brings of a warm-up only,
the event recorder everything while it records. The set of listeners does not change once
they are built; each says what it hears now in its own switches (``hears_accesses``,
``hears_moves``, ``hears_steps``), which it flips as its state changes, and nobody calls it
for a report it does not hear. The mover reads the switches where a bring or a move happens,
so a bring nobody hears calls no listener and enters no module beyond the mover's
(``scripts/hot_path_files.py``); the optimizer's step reports go through ``stepped`` here,
so a step nobody hears enters no listener's module either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridps.client.chunks.chunk import Chunk


class ChunkListener:
    """What hears chunk activity: every switch off and every report ignored until a listener
    says otherwise (see [Note: a listener hears by its own state])."""

    #: called as ``accessed(chunk, device)`` on every bring while on
    hears_accesses: bool = False
    #: called as ``moved(chunk, src, dst, seconds, evicted)`` after every move while on
    hears_moves: bool = False
    #: called as ``stepped(phase, index)`` ("start" or "end" of chunk ``index``'s optimizer step) while on
    hears_steps: bool = False

    def accessed(self, chunk: Chunk, device: str) -> None:
        """``chunk`` was brought to ``device`` for a use."""

    def moved(self, chunk: Chunk, src: str, dst: str, seconds: float, evicted: bool) -> None:
        """``chunk`` moved from ``src`` to ``dst`` in ``seconds`` (``evicted``: to make room)."""

    def stepped(self, phase: str, index: int) -> None:
        """The optimizer's step of chunk ``index`` is at ``phase`` ("start" or "end")."""


class ChunkActivity:
    """The channel of one client's chunk activity: the access clock and the listeners that joined."""

    def __init__(self) -> None:
        #: brings so far (the mover counts them); a chunk's ``last_use`` is this at its last bring
        self.clock = 0
        #: every listener that joined, in the order they did; replaced, never changed in place
        self.listeners: tuple[ChunkListener, ...] = ()

    def join(self, listener: ChunkListener) -> None:
        """``listener`` hears from now on what its switches say (a listener's constructor
        calls this: tests/test_architecture.py holds it)."""
        self.listeners = (*self.listeners, listener)

    def stepped(self, phase: str, index: int) -> None:
        """The optimizer's step of chunk ``index`` is at ``phase`` (the optimizer's step listener)."""
        for listener in self.listeners:
            if listener.hears_steps:
                listener.stepped(phase, index)


class MoveCallback(ChunkListener):
    """A function called after every move from this listener's construction on (tools and tests)."""

    hears_moves = True

    def __init__(self, activity: ChunkActivity, fn):
        #: called as ``fn(chunk, src, dst, seconds, evicted)``
        self.fn = fn
        activity.join(self)

    def moved(self, chunk: Chunk, src: str, dst: str, seconds: float, evicted: bool) -> None:
        self.fn(chunk, src, dst, seconds, evicted)
