"""server/settings.py: the settings page (one writer, readers always get a whole,
consistent copy) and the checks of the trace and logging extensions' changes (the
fronts' tests check them end to end)."""
from __future__ import annotations

import threading

import pytest

from shmserve.errors import ShmServeError
from shmserve.logs import LogOptions
from shmserve.server.settings import SettingsPage, update_log, update_trace

TRACE = {"level": "OFF", "rate": 1000, "count": -1, "mode": "triton", "file": "/tmp/t.json",
         "log_frequency": 0}


def test_readers_never_see_a_torn_page():
    page = SettingsPage.create({"n": 0, "pad": ""})
    reader = SettingsPage.attach(page.path)
    seen, stop = [], threading.Event()

    def read():
        while not stop.is_set():
            seq, settings = reader.read()
            # every write pads to a length of its own: a torn copy would not match
            assert settings["pad"] == "x" * (settings["n"] % 97), settings
            seen.append(seq)

    t = threading.Thread(target=read)
    t.start()
    try:
        for n in range(1, 3000):
            page.write({"n": n, "pad": "x" * (n % 97)})
    finally:
        stop.set()
        t.join(10)
    assert seen == sorted(seen) and reader.read()[1]["n"] == 2999
    reader.close()
    page.close()


def test_trace_changes_are_checked():
    new = update_trace(TRACE, TRACE, {"trace_level": ["TIMESTAMPS"], "trace_rate": "5",
                                      "trace_count": 10, "log_frequency": "2",
                                      "trace_file": "/tmp/t.json"})
    assert (new["level"], new["rate"], new["count"], new["log_frequency"]) == \
        ("TIMESTAMPS", 5, 10, 2)
    assert update_trace(new, TRACE, {"trace_rate": None, "trace_level": []}) == \
        {**new, "rate": 1000, "level": "OFF"}
    for update, words in [({"trace_rate": "0"}, "'trace_rate' must be an integer of at least 1"),
                          ({"trace_count": "-2"}, "at least -1"),
                          ({"trace_rate": True}, "'trace_rate' must be an integer"),
                          ({"trace_rate": ["1", "2"]}, "takes one value"),
                          ({"trace_level": ["TENSORS"]}, "TENSORS is not implemented"),
                          ({"trace_level": ["LOUD"]}, "unknown level 'LOUD'"),
                          ({"trace_file": "/elsewhere"}, "trace file location can not be updated"),
                          ({"trace_mode": "opentelemetry"}, "trace_mode can not be updated"),
                          ({"trace_colour": "1"}, "'trace_colour' is unknown")]:
        with pytest.raises(ShmServeError, match=words):
            update_trace(TRACE, TRACE, update)
    with pytest.raises(ShmServeError, match="needs a trace file"):
        update_trace({**TRACE, "file": None}, TRACE, {"trace_level": "TIMESTAMPS"})


def test_log_changes_are_checked(tmp_path):
    opts = update_log(LogOptions(), {"log_verbose_level": 2, "log_format": "iso8601",
                                     "log_info": False, "log_file": str(tmp_path / "a.log")})
    assert opts == LogOptions(verbose=2, format="ISO8601", info=False,
                              file=str(tmp_path / "a.log"))
    assert update_log(opts, {"log_file": ""}).file is None
    for update, words in [({"log_info": 1}, "'log_info' takes a bool"),
                          ({"log_verbose_level": True}, "takes an integer"),
                          ({"log_verbose_level": -1}, "non-negative"),
                          ({"log_format": "XML"}, "not one of"),
                          ({"log_file": "rel.log"}, "not an absolute path"),
                          ({"log_file": str(tmp_path / "no" / "a.log")}, "cannot open"),
                          ({"log_colour": True}, "'log_colour' is unknown")]:
        with pytest.raises(ShmServeError, match=words):
            update_log(LogOptions(), update)
