"""The pure parts of interactive gangs: cell compilation and message framing."""

from __future__ import annotations

import socket

import pytest

import gangrun
from gangrun.rank import interactive_protocol as protocol
from gangrun.rank.interactive import rank_state
from gangrun.wire.records import ErrorRecord


def _run_cell(source: str, ns: dict):
    body, last = protocol.compile_cell(source, "<gang-cell-test>")
    exec(body, ns)
    return None if last is None else eval(last, ns)


def test_last_expression_is_the_value():
    ns: dict = {}
    assert _run_cell("x = 2\nx * 21", ns) == 42
    assert _run_cell("y = x + 1", ns) is None and ns["y"] == 3
    assert _run_cell("for i in range(3):\n    pass\ni", ns) == 2
    assert _run_cell("", ns) is None
    assert _run_cell("# only a comment", ns) is None
    assert _run_cell("x; y", ns) == 3


def test_syntax_error_names_the_cell():
    with pytest.raises(SyntaxError) as ei:
        protocol.compile_cell("a = 1\nb = (", protocol.cell_filename(7))
    assert ei.value.filename == "<gang-cell-7>"


def test_framing_roundtrip_in_pieces():
    rec = ErrorRecord(1, "ValueError", "bad", "tb", 1.0)
    msgs = [
        protocol.Exec(1, "x = 1"),
        protocol.Ok(b"\x00" * 100_000, 12),
        protocol.Err(rec, 3),
        protocol.Close(),
    ]
    data = b"".join(protocol.frame(m) for m in msgs)
    reader = protocol.Reader()
    got = []
    for i in range(0, len(data), 777):  # arbitrary chunk boundaries
        got += reader.feed(data[i : i + 777])
    assert got == msgs


def test_framing_over_a_socket_and_eof():
    a, b = socket.socketpair()
    with a, b:
        protocol.send(a, protocol.Run(b"payload"))
        assert protocol.recv(b) == protocol.Run(b"payload")
        a.shutdown(socket.SHUT_WR)
        assert protocol.recv(b) is None


def test_anything_but_a_gang_message_is_refused():
    import pickle

    body = pickle.dumps(("exec", 1, "x = 1"))  # the old positional tuples, or anything else
    with pytest.raises(ValueError, match="not a gangrun peer"):
        protocol.Reader().feed(protocol.HEADER.pack(len(body)) + body)


def test_hello_is_fixed_size_and_round_trips():
    hello = protocol.Hello(b"t" * 32, 3, 4242)
    data = hello.pack()
    assert len(data) == protocol.Hello.WIRE.size
    assert protocol.Hello.unpack(data) == hello


def test_oversized_header_is_refused():
    reader = protocol.Reader()
    with pytest.raises(ValueError, match="not a gangrun peer"):
        reader.feed(protocol.HEADER.pack(protocol.MAX_MESSAGE + 1))


def test_rank_state_outside_a_gang_says_where_it_works():
    with pytest.raises(RuntimeError, match="only available on the ranks of a gangrun.Gang"):
        rank_state()
    assert gangrun.rank_state is rank_state


def test_gang_option_errors():
    with pytest.raises(gangrun.LaunchError, match="unknown"):
        gangrun.Gang(processes=2, bogus=1)
    with pytest.raises(gangrun.LaunchError, match="max_restarts"):
        gangrun.Gang(processes=2, max_restarts=-1)
    with pytest.raises(gangrun.LaunchError, match="hang_timeout"):
        gangrun.Gang(processes=2, hang_timeout=-1)
    with pytest.raises(gangrun.LaunchError, match="setup"):
        gangrun.Gang(processes=2, setup=3)
    with pytest.raises(gangrun.LaunchError, match="timeout"):
        gangrun.Gang(processes=2, timeout=-1)


def test_a_rank_that_reaches_no_caller_says_so_within_its_deadline():
    """Something that accepts the connection but is not the gang's caller (a NAT gateway or
    proxy accepts any connection) does not hold a rank until the caller's start_timeout:
    the rank waits for the caller's WELCOME a bounded time."""
    import time

    hello = protocol.Hello(b"t" * 32, 0, 1)
    with socket.socket() as mute:  # accepts (the kernel does) and never answers
        mute.bind(("127.0.0.1", 0))
        mute.listen(1)
        t0 = time.monotonic()
        with pytest.raises(protocol.CallerUnreachable, match="no gangrun caller answered"):
            protocol.handshake(f"tcp://127.0.0.1:{mute.getsockname()[1]}", hello, wait=0.5)
        assert time.monotonic() - t0 < 5
        port = mute.getsockname()[1]
    with pytest.raises(protocol.CallerUnreachable, match="could not connect"):
        protocol.handshake(f"tcp://127.0.0.1:{port}", hello, wait=0.5)  # nothing listens
    # the caller's answer lets it through
    with socket.socket() as caller:
        caller.bind(("127.0.0.1", 0))
        caller.listen(1)
        import threading

        def answer():
            conn, _ = caller.accept()
            protocol.recv_exact(conn, protocol.Hello.WIRE.size)
            conn.sendall(protocol.WELCOME)
            conn.close()

        t = threading.Thread(target=answer, daemon=True)
        t.start()
        sock = protocol.handshake(f"tcp://127.0.0.1:{caller.getsockname()[1]}", hello, wait=5)
        sock.close()
        t.join(5)


def test_ranks_are_answered_before_the_caller_takes_their_connections():
    """The caller answers a rank's Hello from the moment its listener exists, however long
    the launch takes before it collects the connections: a rank's bounded wait for the
    answer cannot fail a slow start."""
    import time

    from gangrun.interactive.channel import Listener, release

    class Handle:  # what accept() reads of a running call
        world_size = 2

        def done(self) -> bool:
            return False

    token = "ab" * 16
    listener = Listener(None, token)
    try:
        ranks = [
            protocol.handshake(listener.address, protocol.Hello(token.encode(), r, 100 + r), 2.0)
            for r in (1, 0)
        ]
        time.sleep(0.5)  # the launch still running: both ranks already answered
        with pytest.raises(protocol.CallerUnreachable, match="not this gang's caller"):
            protocol.handshake(listener.address, protocol.Hello(b"x" * 32, 0, 9), 2.0)
        socks, pids = listener.accept(Handle(), start_timeout=5)  # type: ignore[arg-type]
        assert pids == {0: 100, 1: 101} and set(socks) == {0, 1}
        release(socks, "")
        for s in ranks:
            s.close()
    finally:
        listener.close()
        release({}, listener.dir)
