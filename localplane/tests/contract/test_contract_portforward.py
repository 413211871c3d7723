"""The port-forward WebSocket: refusals before the upgrade, raw bytes after it, and the close codes."""
import asyncio
import socket
import threading
import time
import uuid

import grpc
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus

from contract_support import error_message, local_only, run_exec, unique, ws_connect

# A one-connection TCP server for inside the guest: "echo" echoes, "bye" says bye and hangs up.
GUEST_SERVER = r"""
import socket, sys
mode, port = sys.argv[1], int(sys.argv[2])
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", port)); s.listen(1)
print("listening", flush=True)
c, _ = s.accept()
if mode == "bye":
    c.sendall(b"bye"); c.close()
else:
    while True:
        d = c.recv(65536)
        if not d:
            break
        c.sendall(d)
print("done", flush=True)
"""


def start_guest_server(stub, mode, port):
    """Run GUEST_SERVER through the agent's Exec in a thread; returns once it listens."""
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.agent_pb import sandbox_agent_pb2 as pb
    listening = threading.Event()
    result = {}

    def run():
        def reqs():
            yield pb.ExecRequest(start=pb.ExecStart(argv=["python3", "-c", GUEST_SERVER, mode, str(port)],
                                                    timeout_seconds=60))
        out = b""
        try:
            for frame in stub.Exec(reqs(), timeout=90):
                if frame.WhichOneof("output") == "stdout":
                    out += frame.stdout
                    if b"listening" in out:
                        listening.set()
                elif frame.WhichOneof("output") == "exit":
                    result["exit"] = frame.exit.exit_code
        except grpc.RpcError as e:
            result["error"] = e.code()  # the session went away under the command: expected in some tests
        finally:
            result["stdout"] = out
            listening.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert listening.wait(60), "the guest server did not start"
    assert "exit" not in result, result
    return t, result


def dial_status(plane, sid, port, token=True):
    async def dial():
        async with ws_connect(plane, sid, port, token=token):
            pass
    try:
        asyncio.run(dial())
    except InvalidStatus as e:
        return e.response.status_code
    return 101


@pytest.mark.parametrize("port", [0, 22, 1023, 65536, 99999])
def test_ports_outside_1024_65535_are_400(plane, sandbox, port):
    assert dial_status(plane, sandbox["session_id"], port) == 400


def test_non_numeric_port_is_refused(plane, api, sandbox):
    resp = api.call("GET", "/sessions/%s/port-forward/http" % sandbox["session_id"])
    assert resp.status_code in (400, 404)


def test_unknown_session_is_404(plane):
    assert dial_status(plane, str(uuid.uuid4()), 8443) == 404


def test_deleted_session_is_gone(plane):
    client = plane.client()
    s = client.create_session({"name": unique()})
    client.wait_session(s["session_id"])
    client.delete_session(s["session_id"])
    assert dial_status(plane, s["session_id"], 8443) in (404, 410)


def test_dial_failure_is_a_plain_502(plane, api, sandbox):
    resp = api.call("GET", "/sessions/%s/port-forward/1099" % sandbox["session_id"],
                    headers={"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
                             "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="})
    assert resp.status_code == 502
    assert error_message(resp)


def test_grpc_exec_through_the_port_forward(sandbox, agent):
    stub = agent(sandbox["session_id"])
    code, out, err = run_exec(stub, ["sh", "-c", "echo hello; echo oops >&2; exit 3"])
    assert (code, out, err) == (3, b"hello\n", b"oops\n")


def test_raw_bytes_both_ways_text_ignored_pings_answered(plane, sandbox, agent):
    stub = agent(sandbox["session_id"])
    thread, result = start_guest_server(stub, "echo", 7301)

    async def talk():
        async with ws_connect(plane, sandbox["session_id"], 7301) as ws:
            await ws.send("text frames are ignored")
            await ws.send(b"\x00\x01binary")
            payload = bytes(range(256)) * 1024
            await ws.send(payload)
            got = b""
            while len(got) < 8 + len(payload):
                got += await asyncio.wait_for(ws.recv(), 30)
            assert got == b"\x00\x01binary" + payload
            pong = await ws.ping()
            await asyncio.wait_for(pong, 10)
    asyncio.run(talk())
    # No half-close: closing the WebSocket closed the guest side, so the server finished.
    thread.join(30)
    assert result.get("exit") == 0, result


def test_guest_hang_up_closes_with_1000(plane, sandbox, agent):
    stub = agent(sandbox["session_id"])
    start_guest_server(stub, "bye", 7302)

    async def talk():
        async with ws_connect(plane, sandbox["session_id"], 7302) as ws:
            assert await asyncio.wait_for(ws.recv(), 30) == b"bye"
            with pytest.raises(ConnectionClosed) as e:
                await asyncio.wait_for(ws.recv(), 30)
            return e.value.rcvd.code
    assert asyncio.run(talk()) == 1000


@pytest.mark.parametrize("action", ["pause", "delete"])
def test_session_going_away_mid_connection_closes_4001(plane, api, make_session, agent, action):
    s = make_session()
    stub = agent(s["session_id"])
    start_guest_server(stub, "echo", 7303)

    async def talk():
        async with ws_connect(plane, s["session_id"], 7303) as ws:
            await ws.send(b"ping")
            assert await asyncio.wait_for(ws.recv(), 30) == b"ping"
            loop = asyncio.get_running_loop()
            if action == "pause":
                resp = await loop.run_in_executor(None, lambda: api.call("POST", "/sessions/%s/pause" % s["session_id"], json={}))
            else:
                resp = await loop.run_in_executor(None, lambda: api.call("DELETE", "/sessions/%s" % s["session_id"]))
            assert resp.status_code == 204
            with pytest.raises(ConnectionClosed) as e:
                while True:
                    await asyncio.wait_for(ws.recv(), 30)
            return e.value.rcvd.code
    assert asyncio.run(talk()) == 4001


def test_a_dial_wakes_a_paused_session(plane, api, sandbox, agent):
    sid = sandbox["session_id"]
    assert api.call("POST", "/sessions/%s/pause" % sid, json={}).status_code == 204
    api.wait(sid, ("PAUSED",))
    stub = agent(sid)
    code, out, _err = run_exec(stub, ["echo", "awake"])
    assert (code, out) == (0, b"awake\n")
    assert api.wait(sid, ("READY", "DETACHED"))["status"] != "SESSION_STATUS_PAUSED"


@local_only
def test_garbage_does_not_hurt_the_server_or_other_sessions(plane, api, sandbox, agent):
    host, port = plane.url.split("//", 1)[1].rsplit(":", 1)
    for junk in (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64, b"GET / HTTP/9.9\r\n\r\n",
                 b"\xff" * 70000):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(junk)
            sock.settimeout(5)
            try:
                sock.recv(1024)
            except OSError:
                pass

    # A WebSocket that sends garbage frames after the upgrade is closed; the server lives on.
    async def bad_client():
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(("GET /v2/agents/sessions/%s/port-forward/8443 HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                      "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                      "Sec-WebSocket-Version: 13\r\nAuthorization: Bearer %s\r\n\r\n"
                      % (sandbox["session_id"], plane.token)).encode())
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        assert b" 101 " in head
        writer.write(b"\x8f\x85garbage-frame-with-a-bad-opcode" * 4)
        await writer.drain()
        try:
            await asyncio.wait_for(reader.read(), 10)
        except (asyncio.TimeoutError, ConnectionError):
            pass
        writer.close()
    asyncio.run(bad_client())
    time.sleep(0.2)
    stub = agent(sandbox["session_id"])
    assert run_exec(stub, ["true"])[0] == 0
    assert api.call("GET", "/sessions").status_code == 200
