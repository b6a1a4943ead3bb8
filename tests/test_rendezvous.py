"""``elastictrain-c10d``'s timing from ``--rdzv-conf``: torch's keys, fractions of a second allowed; the round's
state read every ``poll_interval`` instead of torch's once a second."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest

from elastictrain.core.errors import ConfigError
from elastictrain.launcher.rendezvous import (
    KEEP_ALIVE_INTERVAL_S,
    KEEP_ALIVE_MAX_ATTEMPT,
    POLL_INTERVAL_S,
    PollingOpExecutor,
    Timing,
    timing_of,
)

NONE = {"join": None, "last_call": None, "close": None, "heartbeat": None}


@pytest.mark.parametrize("config, expected", [
    ({}, Timing(NONE, KEEP_ALIVE_INTERVAL_S, KEEP_ALIVE_MAX_ATTEMPT)),  # torch's defaults throughout
    # torchrun passes every value as a string; whole seconds as torch reads them
    ({"last_call_timeout": "2", "keep_alive_interval": "1", "keep_alive_max_attempt": "4"},
     Timing({**NONE, "last_call": 2.0}, 1.0, 4)),
    # fractions, which torch's get_as_int refuses
    ({"last_call_timeout": "0.5", "keep_alive_interval": "0.5", "keep_alive_max_attempt": "3", "join_timeout": "60.5"},
     Timing({**NONE, "last_call": 0.5, "join": 60.5}, 0.5, 3)),
    ({"close_timeout": 1.5, "heartbeat_timeout": 0.25, "is_host": "1"},  # numbers too; other keys are not its own
     Timing({**NONE, "close": 1.5, "heartbeat": 0.25}, KEEP_ALIVE_INTERVAL_S, KEEP_ALIVE_MAX_ATTEMPT)),
    ({"poll_interval": "0.05"}, Timing(NONE, KEEP_ALIVE_INTERVAL_S, KEEP_ALIVE_MAX_ATTEMPT, 0.05)),
])
def test_timing_of_reads_seconds_with_fractions(config, expected):
    assert timing_of(config) == expected


@pytest.mark.parametrize("config, said", [
    ({"keep_alive_interval": "half"}, "--rdzv-conf keep_alive_interval=half: give a positive number of seconds"),
    ({"last_call_timeout": "0"}, "--rdzv-conf last_call_timeout=0: give a positive number of seconds"),
    ({"join_timeout": "-1"}, "--rdzv-conf join_timeout=-1: give a positive number of seconds"),
    ({"close_timeout": "inf"}, "--rdzv-conf close_timeout=inf: give a positive number of seconds"),
    ({"keep_alive_max_attempt": "2.5"}, "--rdzv-conf keep_alive_max_attempt=2.5: give a whole number of heartbeats"),
    ({"keep_alive_max_attempt": "0"}, "--rdzv-conf keep_alive_max_attempt=0: give a whole number of heartbeats"),
    ({"poll_interval": "0"}, "--rdzv-conf poll_interval=0: give a positive number of seconds"),
])
def test_a_value_that_is_not_a_duration_is_refused_in_one_line(config, said):
    with pytest.raises(ConfigError) as raised:
        timing_of(config)
    assert str(raised.value).startswith(said)


def test_the_handler_torchrun_builds_keeps_the_fractions(tmp_path):
    # The registered creator, as torchrun calls it: a real c10d store on a free port, hosted here.
    from torch.distributed.elastic.rendezvous.api import RendezvousParameters

    from elastictrain.launcher.rendezvous import c10d
    from tests.helpers.agents import free_port

    params = RendezvousParameters("elastictrain-c10d", f"127.0.0.1:{free_port()}", "timing-test", 1, 2,
                                  keep_alive_interval="0.5", last_call_timeout="0.75", keep_alive_max_attempt="3",
                                  is_host="1")
    handler = c10d()(params)
    settings = handler._inner._settings  # torch's DynamicRendezvousHandler inside the round-publishing wrapper
    assert settings.keep_alive_interval == timedelta(seconds=0.5) and settings.keep_alive_max_attempt == 3
    assert settings.timeout.last_call == timedelta(seconds=0.75)
    assert handler.get_backend() == "elastictrain-c10d"
    # the round's state read every poll_interval (its default here), by the executor and through the holder's cache
    assert isinstance(handler._inner._op_executor, PollingOpExecutor)
    assert handler._inner._op_executor._poll_s == POLL_INTERVAL_S == handler._inner._state_holder._cache_duration
    handler.shutdown()


class RoundsHolder:
    """A rendezvous state holder whose every read finds the next round (round = the number of reads so far)."""

    def __init__(self):
        self.reads = 0
        self.state = SimpleNamespace(round=0)

    def sync(self):
        self.reads += 1
        self.state = SimpleNamespace(round=self.reads)
        return None

    def mark_dirty(self):
        pass


def test_an_operation_waiting_for_other_agents_reads_the_round_every_poll_interval(monkeypatch):
    # An operation that waits (torch's SYNC) until the third read: torch's loop sleeps a whole second before each
    # read (its _delay, made to fail here); this one sleeps the poll interval, and the operation goes on from the
    # state each read found.
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as torch_rdzv

    def no_whole_second(seconds):
        raise AssertionError(f"torch's {seconds} s wait was taken")

    monkeypatch.setattr(torch_rdzv, "_delay", no_whole_second)
    settings = torch_rdzv.RendezvousSettings("poll-test", 1, 2, torch_rdzv.RendezvousTimeout(),
                                             timedelta(seconds=5), 3)
    slept, seen = [], []
    holder = RoundsHolder()
    executor = PollingOpExecutor(torch_rdzv._NodeDesc("a", 1, 0), holder, settings, 0.05, sleep=slept.append)

    def join(ctx, deadline):
        seen.append(ctx.state.round)
        return torch_rdzv._Action.FINISH if ctx.state.round >= 3 else torch_rdzv._Action.SYNC

    executor.run(join, deadline=0.0)
    assert seen == [1, 2, 3]  # torch's loop reads first; each wait then reads again
    assert slept == [0.05, 0.05]


def test_a_bad_value_ends_torchruns_handler_creation_with_its_line_and_exit_2(capsys):
    # torchrun prints an exception from a handler's creator with its traceback: the creator says the line and exits.
    from torch.distributed.elastic.rendezvous.api import RendezvousParameters

    from elastictrain.launcher.rendezvous import c10d

    params = RendezvousParameters("elastictrain-c10d", "127.0.0.1:0", "timing-test", 1, 2, keep_alive_interval="fast")
    with pytest.raises(SystemExit) as exited:
        c10d()(params)
    assert exited.value.code == 2
    assert capsys.readouterr().err == ("elastictrain: error: --rdzv-conf keep_alive_interval=fast: give a positive "
                                       "number of seconds, e.g. keep_alive_interval=0.5\n")


def test_an_agent_leaving_takes_its_node_out_of_the_round_the_other_is_in(tmp_path, caplog):
    # Two agents' handlers, as torchrun builds them, form a round of two on a real c10d store; one leaves (what its
    # exit does after a SIGTERM): the round holds the other alone, so its next round need not wait for the leaver's
    # heartbeat to go stale. After torchrun's shutdown (the job's end) leaving changes nothing: the rendezvous stays
    # closed.
    import threading

    from torch.distributed.elastic.rendezvous.api import RendezvousParameters

    from elastictrain.launcher.rendezvous import c10d, leave_round
    from tests.helpers.agents import free_port

    caplog.set_level("DEBUG", logger="torch.distributed.elastic.rendezvous")  # on a failure: every state the ops saw
    endpoint = f"127.0.0.1:{free_port()}"
    # min_nodes = max_nodes = 2: the round completes once both joined, never with one alone however late the other
    # A heartbeat a second (not 0.25 s): fewer writes for a joining handler's compare-and-set to lose against.
    conf = {"keep_alive_interval": "1", "keep_alive_max_attempt": "30", "join_timeout": "60"}
    host = c10d()(RendezvousParameters("elastictrain-c10d", endpoint, "leave-test", 2, 2, is_host="1", **conf))
    other = c10d()(RendezvousParameters("elastictrain-c10d", endpoint, "leave-test", 2, 2, is_host="0", **conf))
    joined = threading.Thread(target=other.next_rendezvous)
    joined.start()
    host.next_rendezvous()
    joined.join(60)

    def participants():
        holder = host._inner._state_holder
        holder._cache_duration = 0  # read the store itself
        holder.sync()
        return set(holder.state.participants)

    both = participants()
    assert len(both) == 2
    assert leave_round(other._inner)
    assert participants() == both - {other._inner._this_node}
    host.shutdown()
    assert leave_round(host._inner) and host.is_closed()
    other.shutdown()


def test_an_agent_leaves_at_exit_only_after_a_signal_and_while_the_rendezvous_answers():
    # torchrun shuts the handler down at the job's end and after an error (the store lost with its host): nothing to
    # leave then. After a signal it does not, and the agent leaves if the rendezvous endpoint still answers.
    import socket

    from torch.distributed.elastic.rendezvous.api import RendezvousParameters

    from elastictrain.launcher.rendezvous import c10d, reachable
    from tests.helpers.agents import free_port

    listening = socket.create_server(("127.0.0.1", 0))
    endpoint = listening.getsockname()
    assert reachable(endpoint)
    listening.close()
    assert not reachable(endpoint)
    handler = c10d()(RendezvousParameters("elastictrain-c10d", f"127.0.0.1:{free_port()}", "exit-test", 1, 2,
                                          is_host="1"))
    assert not handler.shut_down
    handler.shutdown()
    assert handler.shut_down
