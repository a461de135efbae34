"""What the wire alone gives: the tree's exchange pattern without TensorFlow.

The collective's figures on emulated links (`benchmarks/collective.py
--link`) are read against the link floor. This benchmark measures what the
emulated link and the transport give with no TensorFlow, no arithmetic and
no tf_adasum in the data path, so that a figure against the floor can be
split into the wire's share and the software's:

* ``--pattern halving`` (default): the vector-halving tree's exchanges of an
  S-byte buffer with nothing computed. Level k (k = 0, 1, ...) swaps
  S / 2^(k+1) bytes with rank ``r XOR 2^k``, and the gather swaps the same
  amounts back in reverse order: 2(N-1)/N x S bytes out of each rank, the
  link floor's bytes. N is a power of two.
* ``--pattern stream``: rank 0 sends S bytes to rank 1 over one connection,
  rank 1 answers one byte when it has them all (N = 2): the rate one TCP
  stream (or one MPI message train) reaches on the link.

Two transports (``--transport``, default both):

* ``sockets``: Python's ``socket``, one TCP connection per pair of workers;
  within a swap one thread sends while the calling thread receives. The
  workers are started by ``tf-adasum launch`` and find each other in
  ``TF_CONFIG``; they import neither TensorFlow nor tf_adasum.
* ``mpi``: mpi4py under ``mpirun``, each swap in messages of at most
  ``--message-bytes`` bytes (0: one message per swap). By default each
  message's receive is posted just before its send; with
  ``--receives-first`` every receive of the swap is posted before the first
  send. Open MPI's waits poll the network without pause, which on emulated
  hosts takes the shared cores from the ranks that have work; with
  ``--yield-when-idle`` (Open MPI's ``mpi_yield_when_idle``) a waiting rank
  yields its core, as a rank on a host of its own needs not.

With ``--link RATE`` every process runs on an emulated host of its own
(``tf-adasum launch --hosts N --link RATE``, with ``--mpirun`` for MPI), as
in `benchmarks/collective.py`. Times are the slowest rank's, per call, the
median over ``--process-repeats`` calls after ``--process-warmup`` untimed
ones, every call started together after a barrier. One JSON object per
configuration: ``pattern``, ``transport``, ``replicas``, ``bytes``,
``message_bytes``, ``receives_first`` and ``yield_when_idle`` (mpi), ``ms``, and with ``--link``
``link``, ``link_floor_ms`` (halving: the collective's
`link_floor_ms`) and ``ratio_to_link_floor``, or ``gbit_per_s`` (stream:
8 S / ms, in 10^9 bits per second); and the run's ``date``, ``commit``,
``processor`` and ``command``.

``--table FILE`` prints the Markdown table of the records in FILE (the
cluster guide's table is that output; tests/test_doc_records.py checks).

Usage: python benchmarks/bare_exchange.py [--pattern halving] [--transport sockets mpi]
       [--replicas 2 4] [--sizes 16777216] [--message-bytes 0 1048576 262144]
       [--receives-first] [--yield-when-idle] [--process-repeats 11] [--process-warmup 3] [--link 1gbit]
       [--timeout 600]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from collective import link_floor_ms  # noqa: E402  (the collective's floor, so the two compare)

TRANSPORTS = ("sockets", "mpi")
ROLES = ("sockets-worker", "mpi-rank")  # what the spawned processes run
#: A swap's sends and receives go in pieces of this size (sockets).
SOCKET_PIECE = 1 << 20


def _parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", metavar="FILE", help="print the Markdown table of the records in FILE and exit")
    parser.add_argument("--pattern", choices=["halving", "stream"], default="halving")
    parser.add_argument("--transport", nargs="+", default=list(TRANSPORTS), choices=list(TRANSPORTS) + list(ROLES))
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4], help="process counts (powers of two)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[16 << 20], help="buffer sizes in bytes")
    parser.add_argument(
        "--message-bytes", type=int, nargs="+", default=[0], help="mpi: the largest message of a swap (0: whole swaps)"
    )
    parser.add_argument("--receives-first", action="store_true", help="mpi: post every receive of a swap first")
    parser.add_argument(
        "--yield-when-idle", action="store_true", help="mpi: a waiting rank yields its core (mpi_yield_when_idle)"
    )
    parser.add_argument("--process-repeats", type=int, default=11, help="timed calls per measurement")
    parser.add_argument("--process-warmup", type=int, default=3, help="untimed calls before the timed ones")
    parser.add_argument("--link", metavar="RATE", help="each process on an emulated host, links at RATE (e.g. 1gbit)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds each group of processes may take")
    args = parser.parse_args(argv)
    bad = [n for n in args.replicas if n < 2 or n & (n - 1)]
    if bad:
        parser.error(f"--replicas takes powers of two from 2. Received: {bad}")
    if args.pattern == "stream" and args.replicas != [2] and not set(args.transport) & set(ROLES):
        parser.error(f"--pattern stream runs between two processes (--replicas 2). Received: {args.replicas}")
    if any(m < 0 for m in args.message_bytes):
        parser.error(f"--message-bytes takes sizes >= 0. Received: {args.message_bytes}")
    uneven = [s for s in args.sizes if s <= 0 or s % max(args.replicas)]
    if uneven:  # every level of the pattern halves whole bytes, as the floor assumes
        parser.error(
            f"--sizes takes positive multiples of the largest --replicas ({max(args.replicas)}). Received: {uneven}"
        )
    if args.process_repeats < 1 or args.process_warmup < 0 or args.timeout <= 0:
        parser.error(
            "--process-repeats takes at least 1, --process-warmup at least 0, --timeout a positive number. Received: "
            f"{args.process_repeats}, {args.process_warmup}, {args.timeout}"
        )
    return args


def swaps(rank: int, n: int, nbytes: int) -> list[tuple[int, int, int, int]]:
    """The halving pattern's swaps of rank `rank` among `n`, in order: (peer,
    send offset, receive offset, length) in bytes of an `nbytes` buffer,
    the reduce-scatter's levels and then the gather's in reverse.

    Examples:
        >>> swaps(0, 4, 16)
        [(1, 8, 0, 8), (2, 4, 0, 4), (2, 0, 4, 4), (1, 0, 8, 8)]
    """
    scatter = []
    start, length, bit = 0, nbytes, 1
    while bit < n:
        half = length // 2
        keep_low = not rank & bit
        kept, given = (start, start + half) if keep_low else (start + half, start)
        scatter.append((rank ^ bit, given, kept, half))
        start, length, bit = kept, half, bit << 1
    gather = [(peer, kept, given, half) for peer, given, kept, half in reversed(scatter)]
    return scatter + gather


# -- the parent: spawns the processes, prints their records -------------------------


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    if args.table:
        with open(args.table, encoding="utf-8") as f:
            print(table([json.loads(line) for line in f if line.strip()]), end="")
        return
    if args.transport == ["sockets-worker"]:
        return _sockets_worker(args)
    if args.transport == ["mpi-rank"]:
        return _mpi_rank(args)
    from tf_adasum.eval import provenance

    fields = provenance.fields(provenance.command_line(__file__, argv))
    for transport in args.transport:
        for n in args.replicas:
            messages = args.message_bytes if transport == "mpi" else [0]
            for message_bytes in messages:
                for record in _spawn(transport, n, message_bytes, args):
                    print(json.dumps({**_with_link(record, args), **fields}), flush=True)


def _spawn(transport, n, message_bytes, args):
    """Runs this script as `n` processes; returns the records of process 0."""
    import subprocess

    script = os.path.abspath(__file__)
    hosts = ["--hosts", str(n), "--link", args.link] if args.link else []
    forwarded = ["--pattern", args.pattern, "--sizes", *map(str, args.sizes)]
    forwarded += ["--process-repeats", str(args.process_repeats), "--process-warmup", str(args.process_warmup)]
    forwarded += ["--replicas", str(n), "--timeout", str(args.timeout)]
    if transport == "sockets":
        command = [sys.executable, "-m", "tf_adasum.launch", "-n", str(n), *hosts, script]
        command += ["--transport", "sockets-worker"]
        prefix = "[worker 0] "
    else:
        forwarded += ["--message-bytes", str(message_bytes)] + (["--receives-first"] if args.receives_first else [])
        forwarded += ["--yield-when-idle"] if args.yield_when_idle else []
        if args.link:
            command = [sys.executable, "-m", "tf_adasum.launch", "-n", str(n), *hosts, "--mpirun", script]
            prefix = "[mpirun] "
        else:
            from tf_adasum.launcher.mpirun import mpirun_command

            command = mpirun_command(n) + [sys.executable, script]
            prefix = ""
        command += ["--transport", "mpi-rank"]
    env = {**os.environ, **({"OMPI_MCA_mpi_yield_when_idle": "1"} if args.yield_when_idle else {})}
    try:
        result = subprocess.run(command + forwarded, capture_output=True, text=True, env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"{transport} with {n} processes did not finish within --timeout {args.timeout:g} s") from None
    if result.returncode:
        raise SystemExit(f"{transport} with {n} processes failed:\n{(result.stdout + result.stderr)[-4000:]}")
    return [json.loads(line[len(prefix) :]) for line in result.stdout.splitlines() if line.startswith(prefix + "{")]


def _with_link(record, args):
    if not args.link:
        return record
    record["link"] = args.link
    if record["pattern"] == "stream":
        record["gbit_per_s"] = round(8 * record["bytes"] / (record["ms"] * 1e-3) / 1e9, 3)
    else:
        floor = link_floor_ms(record["replicas"], record["bytes"], args.link)
        record["link_floor_ms"] = round(floor, 3)
        record["ratio_to_link_floor"] = round(record["ms"] / floor, 3)
    return record


def _record(args, transport, n, nbytes, ms, **extra):
    return {"benchmark": "bare_exchange", "pattern": args.pattern, "transport": transport, "replicas": n,
            "bytes": nbytes, **extra, "ms": round(ms, 3)}  # fmt: skip


def _slowest_median_ms(call_times_per_rank):
    """Per call the slowest rank's time, then the median over calls, in ms."""
    return 1e3 * statistics.median(max(times) for times in zip(*call_times_per_rank))


# -- sockets -------------------------------------------------------------------


def _recv_into(sock, view):
    while view.nbytes:
        got = sock.recv_into(view)
        if not got:
            raise ConnectionError("a peer closed its connection")
        view = view[got:]


def _sendall_pieces(sock, view):
    for start in range(0, view.nbytes, SOCKET_PIECE):
        sock.sendall(view[start : start + SOCKET_PIECE])


def _swap(sock, out, into):
    """Sends `out` while receiving `into` over `sock` (the send on a thread)."""
    sender = threading.Thread(target=_sendall_pieces, args=(sock, out))
    sender.start()
    for start in range(0, into.nbytes, SOCKET_PIECE):
        _recv_into(sock, into[start : start + SOCKET_PIECE])
    sender.join()


def _connect_all(rank, addresses, timeout):
    """One connected TCP socket to every other worker: the lower rank
    listens on its TF_CONFIG address, the higher connects (and says who it is)."""
    host, port = addresses[rank].rsplit(":", 1)
    listener = socket.create_server((host, int(port)), backlog=len(addresses))
    listener.settimeout(timeout)
    peers = {}
    for peer in range(rank):
        peer_host, peer_port = addresses[peer].rsplit(":", 1)
        deadline = time.monotonic() + 60
        while True:
            try:
                sock = socket.create_connection((peer_host, int(peer_port)), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        sock.settimeout(None)
        sock.sendall(struct.pack("!I", rank))
        peers[peer] = sock
    for _ in range(rank + 1, len(addresses)):
        sock, _ = listener.accept()
        header = bytearray(4)
        _recv_into(sock, memoryview(header))
        peers[struct.unpack("!I", header)[0]] = sock
    listener.close()
    for sock in peers.values():
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(timeout)  # a peer that stops answering ends this worker, and the launcher stops the rest
    return peers


def _sockets_barrier(rank, peers):
    one = bytearray(1)
    if rank == 0:
        for sock in peers.values():
            _recv_into(sock, memoryview(one))
        for sock in peers.values():
            sock.sendall(b"b")
    else:
        peers[0].sendall(b"b")
        _recv_into(peers[0], memoryview(one))


def _sockets_call(args, rank, n, peers, buffer):
    """One call of the pattern over `peers` (rank -> socket) on `buffer`."""
    if args.pattern == "stream":
        one = bytearray(1)
        if rank == 0:
            _sendall_pieces(peers[1], buffer)
            _recv_into(peers[1], memoryview(one))
        else:
            _recv_into(peers[0], buffer)
            peers[0].sendall(b"d")
        return
    for peer, send_at, receive_at, length in swaps(rank, n, buffer.nbytes):
        _swap(peers[peer], buffer[send_at : send_at + length], buffer[receive_at : receive_at + length])


def _timed(call, barrier, args):
    """This process's seconds per timed call, each call after `barrier`."""
    times = []
    for i in range(args.process_warmup + args.process_repeats):
        barrier()
        start = time.perf_counter()
        call()
        if i >= args.process_warmup:
            times.append(time.perf_counter() - start)
    return times


def _sockets_worker(args):
    """One worker of `tf-adasum launch`: the pattern over Python sockets."""
    config = json.loads(os.environ["TF_CONFIG"])
    addresses, rank = config["cluster"]["worker"], config["task"]["index"]
    n = len(addresses)
    peers = _connect_all(rank, addresses, args.timeout)
    for nbytes in args.sizes:
        buffer = memoryview(np.zeros(nbytes, np.uint8)).cast("B")
        times = _timed(
            lambda b=buffer: _sockets_call(args, rank, n, peers, b), lambda: _sockets_barrier(rank, peers), args
        )
        everyone = _sockets_gather(rank, peers, times)
        if rank == 0:
            print(json.dumps(_record(args, "sockets", n, nbytes, _slowest_median_ms(everyone))), flush=True)


def _sockets_gather(rank, peers, times):
    """Every rank's call times, at rank 0 (in rank order; None elsewhere)."""
    if rank != 0:
        data = json.dumps(times).encode()
        peers[0].sendall(struct.pack("!I", len(data)) + data)
        return None
    everyone = [times]
    for peer in sorted(peers):
        header = bytearray(4)
        _recv_into(peers[peer], memoryview(header))
        data = bytearray(struct.unpack("!I", header)[0])
        _recv_into(peers[peer], memoryview(data))
        everyone.append(json.loads(data))
    return everyone


# -- MPI -----------------------------------------------------------------------


def _mpi_swap(comm, MPI, out, into, peer, message_bytes, receives_first):
    """Sends `out` to and receives `into` from `peer`, in messages of at most
    `message_bytes` (0: one each), each receive posted just before its send
    (or all receives first)."""
    step = message_bytes or max(out.nbytes, 1)
    starts = range(0, out.nbytes, step)
    requests = []
    if receives_first:
        requests += [comm.Irecv([into[s : s + step], MPI.BYTE], peer) for s in starts]
        requests += [comm.Isend([out[s : s + step], MPI.BYTE], peer) for s in starts]
    else:
        for s in starts:
            requests.append(comm.Irecv([into[s : s + step], MPI.BYTE], peer))
            requests.append(comm.Isend([out[s : s + step], MPI.BYTE], peer))
    MPI.Request.Waitall(requests)


def _mpi_call(args, comm, MPI, buffer):
    """One call of the pattern among `comm`'s ranks on `buffer`."""
    message_bytes = args.message_bytes[0]
    if args.pattern == "stream":
        step, one = message_bytes or buffer.nbytes, np.zeros(1, np.uint8)
        pieces = [buffer[s : s + step] for s in range(0, buffer.nbytes, step)]
        if comm.rank == 0:
            MPI.Request.Waitall([comm.Isend([piece, MPI.BYTE], 1) for piece in pieces])
            comm.Recv([one, MPI.BYTE], 1)
        else:
            MPI.Request.Waitall([comm.Irecv([piece, MPI.BYTE], 0) for piece in pieces])
            comm.Send([one, MPI.BYTE], 0)
        return
    for peer, send_at, receive_at, length in swaps(comm.rank, comm.size, buffer.nbytes):
        out, into = buffer[send_at : send_at + length], buffer[receive_at : receive_at + length]
        _mpi_swap(comm, MPI, out, into, peer, message_bytes, args.receives_first)


def _mpi_rank(args):
    """One rank under mpirun: the pattern over mpi4py."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    for nbytes in args.sizes:
        buffer = np.zeros(nbytes, np.uint8)
        times = _timed(lambda b=buffer: _mpi_call(args, comm, MPI, b), comm.Barrier, args)
        everyone = comm.gather(times, root=0)
        if comm.rank == 0:
            extra = {
                "message_bytes": args.message_bytes[0],
                "receives_first": args.receives_first,
                "yield_when_idle": args.yield_when_idle,
            }
            ms = _slowest_median_ms(everyone)
            print(json.dumps(_record(args, "mpi", comm.size, nbytes, ms, **extra)), flush=True)


# -- the table -----------------------------------------------------------------


def _size(nbytes):
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def _messages(record):
    if record["transport"] != "mpi":
        return ""
    return _size(record["message_bytes"]) if record["message_bytes"] else "whole"


def _receives(record):
    return "first" if record["receives_first"] else "before each send"


#: The columns of `table`: (heading, how a record gives its cell).
TABLE_COLUMNS = (
    ("pattern", lambda r: r["pattern"]),
    ("transport", lambda r: r["transport"]),
    ("N", lambda r: str(r["replicas"])),
    ("buffer", lambda r: _size(r["bytes"])),
    ("messages", _messages),
    ("receives", lambda r: "" if r["pattern"] == "stream" or r["transport"] != "mpi" else _receives(r)),
    ("idle ranks", lambda r: "" if r["transport"] != "mpi" else "yield" if r.get("yield_when_idle") else "poll"),
    ("link", lambda r: r.get("link", "")),
    ("ms", lambda r: f"{r['ms']:.3g}" if r["ms"] < 1000 else f"{r['ms']:.0f}"),
    ("ratio_to_link_floor", lambda r: f"{r['ratio_to_link_floor']:.2f}" if "ratio_to_link_floor" in r else ""),
    ("gbit_per_s", lambda r: f"{r['gbit_per_s']:.2f}" if "gbit_per_s" in r else ""),
    ("date", lambda r: r["date"][:16].replace("T", " ")),
)


def table(records: list[dict]) -> str:
    """The Markdown table of `records`, one row each, in their order."""
    lines = ["| " + " | ".join(h for h, _ in TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    lines += ["| " + " | ".join(cell(r) for _, cell in TABLE_COLUMNS) + " |" for r in records]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
