"""orchestration.publish: the stream loop hands Prefect calls over and goes on; what failed is sent
again, newest value only, when the server answers again."""

import logging
import threading
import time

from stoker.orchestration.publish import BestEffortPublisher


class Server:
    """Stands in for the Prefect API: records what it got; away (raises) or slow on demand."""

    def __init__(self):
        self.got: list[tuple[str, object]] = []
        self.away = False
        self.gate = threading.Event()
        self.gate.set()

    def call(self, key, value):
        def send():
            self.gate.wait(60)
            if self.away:
                raise ConnectionError("All connection attempts failed")
            self.got.append((key, value))

        return send


def wait(check, seconds=30.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


def test_a_hanging_server_never_holds_up_the_caller():
    server, pub = Server(), BestEffortPublisher(logging.getLogger("t"), retry_seconds=0.1)
    server.gate.clear()  # every call hangs
    t0 = time.monotonic()
    for pct in range(100):
        pub.latest("progress", server.call("progress", pct))
    assert time.monotonic() - t0 < 5  # generous: 100 hand-overs, no call made on this thread
    server.gate.set()
    assert wait(lambda: server.got and server.got[-1] == ("progress", 99))
    assert len(server.got) <= 3  # the first (in flight when it hung), maybe one more, the newest
    assert pub.close(timeout=10) == []


def test_an_outage_keeps_the_newest_value_per_key_and_catches_up(caplog):
    server, pub = Server(), BestEffortPublisher(logging.getLogger("t"), retry_seconds=0.1)
    pub.latest("progress", server.call("progress", 1))
    assert wait(lambda: server.got == [("progress", 1)])
    server.away = True
    with caplog.at_level(logging.INFO):
        for pct in range(2, 50):
            pub.latest("progress", server.call("progress", pct))
        pub.latest("table", server.call("table", ["step 10"]))
        pub.latest("table", server.call("table", ["step 10", "step 20"]))
        assert wait(lambda: pub.failures >= 3)
        server.away = False
        assert wait(lambda: ("progress", 49) in server.got and ("table", ["step 10", "step 20"]) in server.got)
    assert server.got[0] == ("progress", 1) and ("progress", 30) not in server.got  # only the newest
    assert [v for k, v in server.got if k == "table"] == [["step 10", "step 20"]]
    text = caplog.text
    assert text.count("failed (ConnectionError") == 1 and "answers again" in text
    assert pub.close(timeout=10) == []


def test_close_with_the_server_away_gives_up_after_its_timeout_and_names_what_was_left():
    server, pub = Server(), BestEffortPublisher(logging.getLogger("t"), retry_seconds=0.1)
    server.away = True
    pub.latest("progress", server.call("progress", 100))
    t0 = time.monotonic()
    assert pub.close(timeout=1.0) == ["progress"]
    assert time.monotonic() - t0 < 15


def test_close_waits_for_a_server_that_comes_back_and_sends_the_last_values(caplog):
    """The end of a run during an outage: close() tries again every second (not every
    retry_seconds) and the 100% and the final table reach the server once it is back."""
    server, pub = Server(), BestEffortPublisher(logging.getLogger("t"), retry_seconds=30.0)
    server.away = True
    pub.latest("progress", server.call("progress", 93))
    assert wait(lambda: pub.failures >= 1)  # the worker now waits 30 s before trying again
    pub.latest("progress", server.call("progress", 100))
    pub.latest("table", server.call("table", ["step 160"]))
    threading.Timer(2.0, lambda: setattr(server, "away", False)).start()
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO):
        assert pub.close(timeout=20) == []
    assert time.monotonic() - t0 < 10
    assert ("progress", 100) in server.got and ("table", ["step 160"]) in server.got
    assert "waiting up to 20s for it to take the run's last values (progress, table)" in caplog.text


def test_close_that_gives_up_names_the_call_in_flight_and_starts_no_other():
    server, pub = Server(), BestEffortPublisher(logging.getLogger("t"), retry_seconds=0.1)
    server.gate.clear()  # the server hangs
    pub.latest("progress", server.call("progress", 1))
    assert wait(lambda: pub._busy == "progress")
    pub.latest("table", server.call("table", ["step 10"]))
    assert pub.close(timeout=0.5) == ["progress", "table"]
    server.gate.set()  # the hung call ends after close() gave up
    assert wait(lambda: server.got == [("progress", 1)])
    time.sleep(0.5)
    assert server.got == [("progress", 1)]  # the table was not sent after close() gave up


EXIT_SCRIPT = r"""
import logging, sys, threading, time
from stoker.orchestration.publish import BestEffortPublisher

logging.basicConfig(stream=sys.stdout, level=logging.INFO)
made = []

def in_flight():  # ends after the main thread has ended
    threading.main_thread().join()
    print("in-flight call ended", flush=True)

pub = BestEffortPublisher(logging.getLogger("t"))
pub.latest("progress", in_flight)
pub.latest("table", lambda: print("table sent after exit", flush=True))
time.sleep(0.3)
print("main thread ends", flush=True)
"""


def test_no_call_is_started_once_the_main_thread_has_ended():
    """The daemon thread of a process that ends without close() (the flow returned, the
    interpreter shuts down): the call in flight ends, the next is never made."""
    import subprocess
    import sys

    # a non-daemon thread keeps the interpreter in threading._shutdown long enough to see
    script = EXIT_SCRIPT + "threading.Thread(target=time.sleep, args=(1.5,)).start()\n"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "main thread ends" in text and "in-flight call ended" in text, text
    assert "table sent after exit" not in text and "Traceback" not in text, text
