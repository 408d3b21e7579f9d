"""Serve the bundled model and query it with the openai client.

    python examples/serve_openai.py

Starts ``cyformer serve`` on 127.0.0.1 (a free port), waits for /health,
asks for a completion and a streamed one through the official ``openai``
package, then stops the server with SIGTERM (a clean stop, exit status 0).
Needs pip install 'cyformer[serve]' openai.
"""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from openai import OpenAI


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "cyformer", "serve", "--port", str(port)])
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    sys.exit("the server did not start")
                time.sleep(0.2)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=60)
        model = client.models.list().data[0].id
        done = client.completions.create(model=model, prompt="def fib(n):", max_tokens=24, temperature=0)
        print(f"completion ({done.choices[0].finish_reason}):\n{done.choices[0].text}")
        print("streamed:")
        for chunk in client.completions.create(model=model, prompt="import os\n", max_tokens=24,
                                               temperature=0, stream=True):
            print(chunk.choices[0].text, end="", flush=True)
        print()
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=60)
    print(f"server exited with status {code}")
    sys.exit(code)


if __name__ == "__main__":
    main()
