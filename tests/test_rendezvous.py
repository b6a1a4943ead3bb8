"""``elastictrain-c10d``'s timing from ``--rdzv-conf``: torch's keys, fractions of a second allowed."""

from __future__ import annotations

from datetime import timedelta

import pytest

from elastictrain.core.errors import ConfigError
from elastictrain.launcher.rendezvous import KEEP_ALIVE_INTERVAL_S, KEEP_ALIVE_MAX_ATTEMPT, Timing, timing_of

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
    handler.shutdown()


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
