"""Peak memory of a process tree from /proc: the driver's VmHWM, and sampled RSS of its children.

The kernel keeps the Python process's own high-water mark (VmHWM). The Spark JVM (and any pyspark
worker) is a child process whose peak nobody records for us, so a thread samples the RSS of every
descendant every 0.2 s and keeps the largest total seen.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

SAMPLE_INTERVAL_S = 0.2


def status_kib(pid: int, field: str) -> int:
    """A `kB` field of /proc/<pid>/status (VmHWM, VmRSS...); 0 if the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def pss_kib(pid: int) -> int:
    """The process's proportional set size (/proc/<pid>/smaps_rollup `Pss`): its resident pages, each page it
    shares with others (a fork's inherited copy-on-write pages, libraries) counted as its share. Summed over a
    process tree it counts every physical page once, where summing RSS counts a fork's inherited pages again in
    each fork. 0 if the process is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return 0


def _stat(pid: int) -> tuple[str, int] | None:
    """(command name, parent pid) from /proc/<pid>/stat; the name may hold spaces and parentheses."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    name = text[text.index("(") + 1 : text.rindex(")")]
    ppid = int(text[text.rindex(")") + 2 :].split()[1])
    return name, ppid


def descendants(root: int) -> dict[int, str]:
    """Every live descendant of `root`: pid -> command name."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        st = _stat(int(entry))
        if st is not None:
            children.setdefault(st[1], []).append((int(entry), st[0]))
    found: dict[int, str] = {}
    todo = [root]
    while todo:
        for pid, name in children.get(todo.pop(), []):
            if pid not in found:
                found[pid] = name
                todo.append(pid)
    return found


@dataclass
class Peaks:
    jvm_kib: int = 0  # largest sampled RSS total of the `java` descendants
    others_kib: int = 0  # ... of the other descendants (pyspark workers, the spark-submit shell)
    children_kib: int = 0  # largest sampled RSS total of all descendants (at one instant)
    tree_pss_kib: int = 0  # largest sampled PSS total of the root and its descendants (at one instant)
    samples: int = 0
    others_names: list[str] = field(default_factory=list)  # the other descendants at their peak


class ChildrenSampler:
    """Samples the RSS of `root`'s descendants in a daemon thread until `stop()`."""

    def __init__(self, root: int | None = None, interval: float = SAMPLE_INTERVAL_S) -> None:
        self.root = os.getpid() if root is None else root
        self.interval = interval
        self.peaks = Peaks()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-memory-sampler", daemon=True)

    def start(self) -> ChildrenSampler:
        self._thread.start()
        return self

    def stop(self) -> Peaks:
        self._stop.set()
        self._thread.join()
        self.sample()  # one last look
        return self.peaks

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        jvm = others = 0
        names: list[str] = []
        tree = descendants(self.root)
        pss = pss_kib(self.root) + sum(pss_kib(pid) for pid in tree)
        for pid, name in tree.items():
            rss = status_kib(pid, "VmRSS")
            if name == "java":
                jvm += rss
            else:
                others += rss
                names.append(name)
        p = self.peaks
        p.jvm_kib = max(p.jvm_kib, jvm)
        if others > p.others_kib:
            p.others_kib, p.others_names = others, sorted(names)
        p.children_kib = max(p.children_kib, jvm + others)
        p.tree_pss_kib = max(p.tree_pss_kib, pss)
        p.samples += 1
