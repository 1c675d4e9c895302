"""Process helpers shared by the bench scripts: fail clearly, wait for a port, stop a child."""

import os
import socket
import subprocess
import sys
import time


def die(msg):
    """Prints `msg` under the script's name and exits with 2."""
    print(f"bench/{os.path.basename(sys.argv[0])}: {msg}", file=sys.stderr)
    sys.exit(2)


def wait_port(addr, proc=None, timeout=15.0):
    """Waits until something accepts on `addr` ("host:port"); dies if `proc` exits first."""
    host, port = addr.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            die(f"{proc.args} exited with {proc.returncode} before listening on {addr}")
        try:
            with socket.create_connection((host, int(port)), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    die(f"nothing listens on {addr} after {timeout}s")


def stop(proc, timeout=15):
    """SIGTERM, then SIGKILL after `timeout` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
