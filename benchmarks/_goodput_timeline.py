"""Read one faulted job's log back into a timeline and account for every second of its wall time.

The log holds the worker's ``goodput-bench`` lines (unix times, from ``_goodput_worker.py``)
and, for elastictrain, its own log lines (``HH:MM:SS.mmm [elastictrain r0 a3] ...``, local time
to the millisecond). ``account`` splits the wall time (launch to the agent's exit) into:

- ``startup_s``: launch to the first step's forward (process start, imports, rendezvous, set-up);
- ``restart_s``: every kill to the first step of the next attempt that trains;
- ``redone_s``: steps trained again after a restart (their intervals, and the step a kill cut short);
- ``snapshot_s``: training blocked by snapshots taken after steps that count (elastictrain: the
  SNAPSHOT and LOCAL_SNAPSHOT states, from its transition lines; textbook: ``torch.save``'s
  duration);
- ``after_snapshot_s``: what the counted steps from a snapshot to 4 steps after it took beyond
  the median of the others, blocking apart (a background write competing for the two cores);
- ``slower_steps_s``: what the counted steps took beyond the reference step time, the two above
  apart (elastictrain's per-step work, and the load moving between the job and its references);
- ``finish_s``: the last step's forward to the agent's exit, less one reference step
  (the final snapshot, process-group teardown, interpreter exit); a kill that lands after the
  last step restarts the group all the same, and from that kill on the time is ``restart_s``;
- ``unattributed_s``: the rest (a few tens of milliseconds: the edges of the partial steps).

so that ``steps x reference step + all of these = wall``. Each restart is further split at the marks
it passes: the agent's ``failed (exitcode ...)`` line (torch's own log, microseconds), the new
workers' process creation, imports done on the slowest rank, process group up (elastictrain's
``process group gloo up`` line; the textbook worker prints its own), set-up done, state
restored, first forward.
"""

from __future__ import annotations

import datetime
import json
import re
import statistics
from dataclasses import dataclass, field

BENCH_LINE = re.compile(r"^goodput-bench a(\d+) r(\d+) (\w+) ([\d.]+)(.*)$", re.MULTILINE)
ELASTICTRAIN_LINE = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d{3}) \[elastictrain r(\d+) a(\d+)\] (\w+) (.*)$", re.MULTILINE)
TRANSITION = re.compile(r"^state (\w+) -> (\w+) at step (\d+)$")
COMMIT = re.compile(r"^snapshot (\S+) committed: (\d+) bytes in ([\d.]+)s")
PG_UP = re.compile(r"^process group \w+ up:")
# torch's logging: W1123 14:39:18.147000 23445 .../api.py:1028] ... (local time, microseconds)
AGENT_FAILURE = re.compile(r"^[EW]\d{4} (\d\d):(\d\d):(\d\d)\.(\d{6}) \d+ \S+\] failed \(exitcode: (-?\d+)\)", re.MULTILINE)
FAST_RESTORE = re.compile(r"^restored step (\d+) from the node-local tier")
DURABLE_RESTORE = re.compile(r"^restored snapshot (\S+): step (\d+)")
SNAPSHOT_STATES = ("SNAPSHOT", "LOCAL_SNAPSHOT")
AFTER_SNAPSHOT_STEPS = 5  # steps from a snapshot on (it included) whose extra time is charged to it


@dataclass
class Attempt:
    """What one torchrun attempt (one restart count) printed: rank 0's marks, steps and snapshots."""

    restart: int
    events: dict[str, float] = field(default_factory=dict)  # exec, imported, pg, group, restored, done -> unix s
    # exec and imported of the slowest rank: the process group forms only once every rank is there
    slowest: dict[str, float] = field(default_factory=dict)
    restored_step: int | None = None
    done_step: int | None = None  # the step the final model holds, when this attempt finished
    steps: list[tuple[int, float]] = field(default_factory=list)  # (step, unix s of its forward)
    # (step, seconds training was blocked) of every snapshot or checkpoint this attempt took
    snapshots: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Timeline:
    attempts: dict[int, Attempt]
    commits: list[dict]  # elastictrain: {"tier", "bytes", "seconds"} of each committed write
    restores: dict[str, int]  # elastictrain: restarts by where they restored from (node-local, survivor copy, durable, fresh)
    goodput_counter: dict | None  # elastictrain's own counters at the end (rank 0)
    summary_line: str | None
    agent_failures: list[float] = field(default_factory=list)  # unix s of each "failed (exitcode ...)" the agent logged


def parse(log_text: str, launch_unix: float, fast_tier_url: str | None = None) -> Timeline:
    attempts: dict[int, Attempt] = {}
    goodput_counter = None
    for restart, rank, event, when, rest in BENCH_LINE.findall(log_text):
        fields = dict(item.split("=", 1) for item in rest.split())
        attempt = attempts.setdefault(int(restart), Attempt(int(restart)))
        if event in ("exec", "imported"):
            attempt.slowest[event] = max(attempt.slowest.get(event, 0.0), float(when))
        if int(rank) != 0:
            continue
        if event == "step":
            attempt.steps.append((int(fields["step"]), float(when)))
        elif event == "saved":
            attempt.snapshots.append((int(fields["step"]), float(fields["duration_s"])))
        elif event == "goodput":
            goodput_counter = {"ratio": float(fields["ratio"]), "seconds_by_cause": json.loads(fields["seconds"])}
        else:
            attempt.events[event] = float(when)
            if event == "restored":
                attempt.restored_step = int(fields["step"])
            elif event == "done":
                attempt.done_step = int(fields["step"])
    commits, restores, summary_line = [], {"node-local": 0, "survivor copy": 0, "durable": 0, "fresh": 0}, None
    entered: dict[int, tuple[int, float]] = {}  # restart -> (step, time) a snapshot state was entered
    for hours, minutes, seconds, millis, rank, restart, _level, message in ELASTICTRAIN_LINE.findall(log_text):
        if rank != "0":
            continue
        when = _local_clock_to_unix(int(hours), int(minutes), int(seconds), int(millis), launch_unix)
        attempt = attempts.setdefault(int(restart), Attempt(int(restart)))
        if match := TRANSITION.match(message):
            src, dst, step = match.group(1), match.group(2), int(match.group(3))
            if dst in SNAPSHOT_STATES:
                entered[attempt.restart] = (step, when)
            elif src in SNAPSHOT_STATES and attempt.restart in entered:
                snapshot_step, since = entered.pop(attempt.restart)
                attempt.snapshots.append((snapshot_step, when - since))
        elif PG_UP.match(message):
            attempt.events["pg"] = when
        elif match := COMMIT.match(message):
            tier = "node-local" if fast_tier_url and match.group(1).startswith(fast_tier_url) else "durable"
            commits.append({"tier": tier, "bytes": int(match.group(2)), "seconds": float(match.group(3))})
        elif FAST_RESTORE.match(message):
            restores["survivor copy" if "(a survivor copy)" in message else "node-local"] += 1
        elif (match := DURABLE_RESTORE.match(message)) and not (fast_tier_url and match.group(1).startswith(fast_tier_url)):
            restores["durable"] += 1  # a fast-tier restore logs this line too, with the fast tier's URL
        elif message.startswith("no snapshot at") and attempt.restart > 0:
            restores["fresh"] += 1  # killed before the first snapshot: the restart starts from step 0
        elif message.startswith("run summary:"):
            summary_line = message
    agent_failures = [_local_clock_to_unix(int(h), int(m), int(sec), int(micros) / 1000, launch_unix)
                      for h, m, sec, micros, _code in AGENT_FAILURE.findall(log_text)]
    return Timeline(attempts, commits, restores, goodput_counter, summary_line, sorted(agent_failures))


def _local_clock_to_unix(hours: int, minutes: int, seconds: int, millis: float, launch_unix: float) -> float:
    launched = datetime.datetime.fromtimestamp(launch_unix)
    clock = launched.replace(hour=hours, minute=minutes, second=seconds, microsecond=round(millis * 1000))
    if clock.timestamp() < launch_unix - 3600:  # the job ran past midnight
        clock += datetime.timedelta(days=1)
    return clock.timestamp()


def step_intervals(attempt: Attempt) -> list[tuple[int, float]]:
    """(step, seconds from its forward to the next step's forward) for consecutive steps of one attempt."""
    return [(step, later - when) for (step, when), (next_step, later) in zip(attempt.steps, attempt.steps[1:])
            if next_step == step + 1]


def median_step_s(*timelines: Timeline, skip_first: int = 20) -> float:
    """The median step interval over every attempt of the timelines, skipping each attempt's first steps (warm-up)."""
    intervals = [seconds for timeline in timelines for attempt in timeline.attempts.values()
                 for _, seconds in step_intervals(attempt)[skip_first:]]
    return statistics.median(intervals)


def mean_step_s(*timelines: Timeline) -> float:
    """An unbroken run's step time over its training span: first step's forward to the last's, over the steps between.

    Unlike the median it keeps the run's tail (the slow steps every run on a loaded machine has,
    an epoch's end), so a faulted job compared against it is charged only for what it does that
    an unbroken run does not. Several timelines (the references around a job) are pooled.
    """
    span_s = intervals = 0
    for timeline in timelines:
        for attempt in timeline.attempts.values():
            if len(attempt.steps) > 1:
                span_s += attempt.steps[-1][1] - attempt.steps[0][1]
                intervals += attempt.steps[-1][0] - attempt.steps[0][0]
    return span_s / intervals


@dataclass
class Kill:
    unix: float
    since_launch_s: float
    rank: int
    restart: int  # the attempt the victim belonged to
    pid: int


def account(timeline: Timeline, kills: list[Kill], launch_unix: float, exit_unix: float, final_step: int,
            reference_step_s: float) -> dict:
    """Where the wall time went; see the module docstring. Every figure in seconds."""
    stepping = [timeline.attempts[r] for r in sorted(timeline.attempts) if timeline.attempts[r].steps]
    last_attempt_of_step = {step: attempt.restart for attempt in stepping for step, _ in attempt.steps}
    counted_s = redone_s = snapshot_s = 0.0
    counted_intervals = redone_steps = 0
    near_snapshot: list[tuple[float, float]] = []  # (interval, blocking in it) of counted steps just after a snapshot
    far_from_snapshot: list[float] = []
    for attempt in stepping:
        stamped = {step for step, _ in attempt.steps}
        blocked = dict(attempt.snapshots)
        for step, seconds in step_intervals(attempt):
            if last_attempt_of_step[step] == attempt.restart:
                counted_s += seconds
                counted_intervals += 1
                blocking = blocked.get(step, 0.0)
                snapshot_s += blocking
                since = step - max((taken for taken in blocked if taken <= step), default=-AFTER_SNAPSHOT_STEPS)
                if since < AFTER_SNAPSHOT_STEPS:
                    near_snapshot.append((seconds, blocking))
                else:
                    far_from_snapshot.append(seconds)
            else:
                redone_s += seconds
        redone_steps += sum(last_attempt_of_step[step] != attempt.restart for step in stamped)
    # What the steps around a snapshot took beyond the others, blocking apart: a background write
    # competing for the cores, staging's after-effects (the textbook: a new epoch's iterator).
    baseline_s = statistics.median(far_from_snapshot) if far_from_snapshot else reference_step_s
    after_snapshot_s = sum(seconds - blocking - baseline_s for seconds, blocking in near_snapshot)

    first = stepping[0]
    startup = _phases(launch_unix, first, None)
    restarts, partial_s = [], 0.0
    for before, after in zip(stepping, stepping[1:]):
        last_forward = before.steps[-1][1]
        # The kill that ended this attempt: the first one sent after its last forward.
        ended_by = [kill for kill in kills if before.restart <= kill.restart < after.restart and kill.unix >= last_forward]
        killed_at = ended_by[0].unix if ended_by else last_forward
        partial_s += killed_at - last_forward
        noticed = next((when for when in timeline.agent_failures if when >= killed_at - 0.01), None)
        restarts.append({
            "from_step": before.steps[-1][0], "to_step": after.restored_step, "kill_unix": round(killed_at, 3),
            # attempts between the two that never reached a step (a kill in start-up, a failed init)
            "attempts_without_steps": after.restart - before.restart - 1,
            **_phases(killed_at, after, noticed),
        })
    last_forward = stepping[-1].steps[-1][1]
    # A kill after the last step (the final snapshot, teardown, the interpreter's exit) still
    # restarts the group, which restores the final snapshot and finishes: kill to exit is restart time.
    late_kills = [kill for kill in kills if kill.unix >= last_forward]
    finished_at = late_kills[0].unix if late_kills else exit_unix
    restart_s = sum(r["total_s"] for r in restarts) + (exit_unix - finished_at)
    done = timeline.attempts[stepping[-1].restart].events.get("done")
    finish = {"to_done_s": round(done - last_forward, 3) if done and done <= finished_at else None,
              "total_s": round(finished_at - last_forward, 3),
              "kills_after_last_step": len(late_kills), "late_kill_to_exit_s": round(exit_unix - finished_at, 3)}
    finish_s = finished_at - last_forward
    slower_steps_s = counted_s - snapshot_s - after_snapshot_s - counted_intervals * reference_step_s
    wall_s = exit_unix - launch_unix
    parts = {
        "startup_s": startup["total_s"],
        "restart_s": restart_s,
        "redone_s": redone_s + partial_s,
        "snapshot_s": snapshot_s,
        "after_snapshot_s": after_snapshot_s,
        "slower_steps_s": slower_steps_s,
        "finish_s": finish_s - reference_step_s,
    }
    parts["unattributed_s"] = wall_s - final_step * reference_step_s - sum(parts.values())
    return {
        "wall_s": wall_s,
        "parts": {name: round(value, 3) for name, value in parts.items()},
        "redone_steps": redone_steps,
        "counted_step_median_ms": round(1e3 * statistics.median(
            [s for attempt in stepping for step, s in step_intervals(attempt) if last_attempt_of_step[step] == attempt.restart]
        ), 2),
        "snapshots_taken": sum(len(attempt.snapshots) for attempt in timeline.attempts.values()),
        "snapshot_blocked_ms_median": round(1e3 * statistics.median(
            [s for attempt in timeline.attempts.values() for _, s in attempt.snapshots]), 1)
        if any(attempt.snapshots for attempt in timeline.attempts.values()) else None,
        "startup": startup,
        "restart_log": restarts,
        "finish": finish,
    }


def _phases(since_unix: float, attempt: Attempt, agent_noticed_unix: float | None) -> dict:
    """From a moment (launch or kill) to the attempt's first forward, split at the marks in between.

    A mark missing from the log (a line cut off, a loop that has no such mark) gives None, and
    its time goes to the next mark.
    """
    marks = [("to_agent_noticed_s", agent_noticed_unix), ("to_exec_s", attempt.events.get("exec")),
             ("exec_to_imported_s", attempt.slowest.get("imported")), ("imported_to_pg_s", attempt.events.get("pg")),
             ("pg_to_setup_done_s", attempt.events.get("group")), ("setup_done_to_restored_s", attempt.events.get("restored")),
             ("restored_to_first_step_s", attempt.steps[0][1])]
    phases, previous = {}, since_unix
    for name, when in marks:
        if when is None or when < previous:
            phases[name] = None
            continue
        phases[name] = round(when - previous, 3)
        previous = when
    phases["total_s"] = round(attempt.steps[0][1] - since_unix, 3)
    return phases
