"""Starting the real attnserve binary for a test: ephemeral loopback port, CPU engine."""
import os
import signal
import subprocess
import tempfile
import time


class Server:
    """attnserve on 127.0.0.1:<free port>; `target` is where to connect. Extra flags as given."""

    def __init__(self, binary, *flags):
        self._work = tempfile.TemporaryDirectory(prefix="attnserve-test-")
        port_file = os.path.join(self._work.name, "port")
        self.log_path = os.path.join(self._work.name, "server.log")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [binary, "--listen=127.0.0.1:0", f"--port_file={port_file}", "--metrics_address=",
             "--cpu_threads=1", *flags], stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            if os.path.exists(port_file) and open(port_file).read().strip():
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"attnserve did not start listening:\n{self.log()}")
            time.sleep(0.05)
        self.target = "127.0.0.1:" + open(port_file).read().strip()

    def path(self, name):
        """A path in the server's own temporary directory (token files and the like)."""
        return os.path.join(self._work.name, name)

    def log(self):
        self._log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self):
        """SIGTERM, as an operator would; returns the exit code (0 after a clean drain)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._log.close()
        self._work.cleanup()
        return code


def write_token_file(directory, token):
    path = os.path.join(directory, "tokens")
    with open(path, "w") as f:
        f.write(token + "\n")  # a bare token: the identity "default"
    return path
