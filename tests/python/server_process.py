"""An indexer-server child process for the Python tests, on a TCP port it picks or a Unix socket.

The binary is INDEXER_SERVER_BIN (ctest sets it). Its log is kept, for failure messages.
"""
import os
import re
import signal
import subprocess
import threading

HEAD_DIM, LAYERS, CAPACITY = 64, 2, 64
SERVER_FLAGS = ["--device=cpu", f"--head_dim={HEAD_DIM}", f"--layers={LAYERS}",
                f"--capacity={CAPACITY}", "--cpu_threads=2", "--handler_threads=4",
                "--drain_seconds=5"]


def server_binary() -> str:
    binary = os.environ.get("INDEXER_SERVER_BIN")
    if not binary or not os.access(binary, os.X_OK):
        raise RuntimeError(f"INDEXER_SERVER_BIN is {binary!r}; set it to the built indexer-server "
                           "(ctest sets it)")
    return binary


class Server:
    """indexer-server with `flags` (SERVER_FLAGS by default) listening on `listen`: "tcp" (a
    free 127.0.0.1 port) or "unix:PATH". `target` is what a client connects to."""

    def __init__(self, binary=None, flags=SERVER_FLAGS, listen="tcp"):
        self.log = []
        self.port = None
        self.target = None
        self._unix = listen.startswith("unix:")
        self._ready = threading.Event()
        address = listen if self._unix else "127.0.0.1:0"
        command = [binary or server_binary(), f"--listen={address}"] + list(flags)
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._reader = threading.Thread(target=self._read_log, daemon=True)
        self._reader.start()
        if not self._ready.wait(20) or self.proc.poll() is not None or \
                (self.port is None and not self._unix):
            self.proc.kill()
            raise RuntimeError("indexer-server did not start:\n" + "".join(self.log))
        self.target = listen if self._unix else f"127.0.0.1:{self.port}"

    def _read_log(self):
        for line in self.proc.stdout:
            self.log.append(line)
            if "serving on" not in line:
                continue
            # "serving on port N", or "serving on HOST:N" / "serving on unix:PATH".
            match = re.search(r"serving on (?:port |\S*:)(\d+)\b", line)
            if not self._unix and match:
                self.port = int(match.group(1))
            self._ready.set()
        self._ready.set()  # the process ended

    def stop(self):
        """SIGTERM, then the exit status (None if it had to be killed)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None
        finally:
            self._reader.join(5)
            self.proc.stdout.close()


class ModuleServer:
    """The one indexer-server of a test module, started by setUpModule and checked at its end:

        server = ModuleServer()
        setUpModule, tearDownModule = server.start, server.stop_checked

    Its attributes (target, port, log, ...) are the running Server's."""

    def __init__(self, **kwargs):
        self._kwargs = kwargs
        self._server = None

    def start(self):
        self._server = Server(**self._kwargs)

    def stop_checked(self):
        """Stops the server; AssertionError, with its log's end, unless it exited 0."""
        status = self._server.stop()
        if status != 0:
            raise AssertionError(f"indexer-server exited with {status} after SIGTERM (want 0):\n"
                                 + "".join(self._server.log[-20:]))

    def __getattr__(self, name):
        if self._server is None:
            raise AttributeError(f"the module's server is not started (no {name})")
        return getattr(self._server, name)
