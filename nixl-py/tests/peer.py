"""An agent driven line by line through NIXL's Python API, for the two-process and
interop tests: the same script runs a nixl_rs agent or a real NIXL agent.

Usage: peer.py IMPL NAME BUFFER_BYTES BACKEND [LISTEN_PORT]
  IMPL: nixl_rs (``nixl_rs._api``), dropin (``nixl._api`` of nixl-rs' package ``nixl``)
        or nixl (``nixl_cu12._api``, the NIXL wheel)
  BACKEND: a backend name ("TCP" and "TCP-SOCKET": nixl-tcp, the latter with its
        same-host path off), or DEFAULT (``nixl_agent_config()`` as given: UCX)

Answers each command with one line "@@ OK ..." or "@@ ERR ..." on stdout; bytes
travel as hex ("-" for empty). The agent owns one registered DRAM buffer.

  MD                          -> the agent's metadata
  LOAD HEX                    -> add_remote_agent; the peer's name
  FILL OFF LEN BYTE / PATTERN OFF LEN SEED
  DUMP OFF LEN                -> hex of the buffer bytes
  XFER OP PEER OFF LEN RADDR NOTIF
                              -> initialize_xfer + transfer, polled with check_xfer_state
  PREP OP PEER OFF LEN RADDR NOTIF
                              -> the same through prep_xfer_dlist + make_prepped_xfer
  NOTIF PEER HEX              -> send_notif
  NOTIFS COUNT TIMEOUT_S      -> wait for COUNT notifications: "peer:hex ..."
  FETCH PEER IP PORT          -> fetch_remote_metadata, waited for with check_remote_metadata
  SEND IP PORT                -> send_local_metadata
  CHECK PEER TIMEOUT_S        -> wait until check_remote_metadata(PEER)
  HAS PEER                    -> check_remote_metadata(PEER): "True" or "False"
  REMOVE PEER                 -> remove_remote_agent
  POST OP PEER OFF LEN RADDR  -> initialize_xfer + transfer, not waited for; its state
  STATE                       -> check_xfer_state of the last POST: the state, or
                                 "RAISED CLASS MESSAGE" when it raises
  RELEASE                     -> release_xfer_handle of the last POST
  EXIT                        -> leave (nixl_rs: a normal interpreter exit; NIXL: os._exit,
                                 its wheel may crash in its own exit path)
"""

import os
import sys
import time

import numpy as np


def main():
    impl, name, size, backend = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    port = int(sys.argv[5]) if len(sys.argv) > 5 else None
    if impl == "nixl":
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    elif impl == "dropin":
        from nixl._api import nixl_agent, nixl_agent_config
    else:
        from nixl_rs._api import nixl_agent, nixl_agent_config
    kw = {} if backend in ("DEFAULT", "TCP-SOCKET") else {"backends": [backend]}
    if backend == "TCP-SOCKET":
        kw["backends"] = []
    if port is not None:
        cfg = nixl_agent_config(enable_listen_thread=True, listen_port=port, **kw)
    else:
        cfg = nixl_agent_config(**kw)
    agent = nixl_agent(name, cfg)
    if backend == "TCP-SOCKET":
        agent.create_backend("TCP", {"same_host": "off"})
    buf = np.zeros(size, dtype=np.uint8)
    base = buf.ctypes.data
    agent.register_memory(agent.get_reg_descs([(base, size, 0, "")], "DRAM"))
    notifs = []
    posted = [None]

    def out(line):
        sys.stdout.write("@@ " + line + "\n")
        sys.stdout.flush()

    def hx(b):
        return b.hex() if b else "-"

    def unhx(s):
        return b"" if s == "-" else bytes.fromhex(s)

    def collect():
        for peer, msgs in agent.get_new_notifs().items():
            notifs.extend((peer, m) for m in msgs)

    def wait(handle):
        deadline = time.monotonic() + float(os.environ.get("PEER_WAIT", "30"))
        while True:
            st = agent.check_xfer_state(handle)
            if st == "DONE":
                return
            if st != "PROC":
                raise RuntimeError(f"transfer state {st}")
            if time.monotonic() > deadline:
                raise RuntimeError("transfer did not finish in %s s" % os.environ.get("PEER_WAIT", "30"))
            time.sleep(0.0005)

    out(f"OK ready {base} {size} {agent.listen_port if impl == 'nixl_rs' and port is not None else port or 0}")
    for line in sys.stdin:
        w = line.split()
        if not w:
            continue
        try:
            cmd = w[0]
            if cmd == "MD":
                out("OK " + hx(agent.get_agent_metadata()))
            elif cmd == "LOAD":
                peer = agent.add_remote_agent(unhx(w[1]))
                out("OK " + (peer.decode() if isinstance(peer, bytes) else peer))
            elif cmd == "FILL":
                off, n, byte = int(w[1]), int(w[2]), int(w[3])
                buf[off:off + n] = byte
                out("OK")
            elif cmd == "PATTERN":
                off, n, seed = int(w[1]), int(w[2]), int(w[3])
                buf[off:off + n] = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
                out("OK")
            elif cmd == "DUMP":
                off, n = int(w[1]), int(w[2])
                out("OK " + hx(buf[off:off + n].tobytes()))
            elif cmd in ("XFER", "PREP"):
                op, peer, off, n, raddr, notif = w[1], w[2], int(w[3]), int(w[4]), int(w[5]), unhx(w[6])
                if cmd == "XFER":
                    local = agent.get_xfer_descs([(base + off, n, 0)], "DRAM")
                    remote = agent.get_xfer_descs([(raddr, n, 0)], "DRAM")
                    h = agent.initialize_xfer(op, local, remote, peer, notif)
                    agent.transfer(h)
                    wait(h)
                    agent.release_xfer_handle(h)
                else:
                    half = n // 2
                    loc = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(base + off, half, 0), (base + off + half, n - half, 0)], "DRAM")
                    rem = agent.prep_xfer_dlist(peer, np.array([[raddr, half, 0], [raddr + half, n - half, 0]], dtype=np.uint64), "DRAM")
                    h = agent.make_prepped_xfer(op, loc, np.array([0, 1]), rem, [0, 1], notif_msg=notif)
                    agent.transfer(h)
                    wait(h)
                    agent.release_xfer_handle(h)
                    agent.release_dlist_handle(loc)
                    agent.release_dlist_handle(rem)
                out("OK")
            elif cmd == "NOTIF":
                agent.send_notif(w[1], unhx(w[2]))
                out("OK")
            elif cmd == "NOTIFS":
                count, timeout = int(w[1]), float(w[2])
                deadline = time.monotonic() + timeout
                collect()
                while len(notifs) < count and time.monotonic() < deadline:
                    time.sleep(0.001)
                    collect()
                got = notifs[:count]
                del notifs[:count]
                out("OK " + " ".join(f"{p}:{hx(m)}" for p, m in got))
            elif cmd == "FETCH":
                agent.fetch_remote_metadata(w[1], w[2], int(w[3]))
                deadline = time.monotonic() + 30
                while not agent.check_remote_metadata(w[1]):
                    if time.monotonic() > deadline:
                        raise RuntimeError("metadata did not arrive in 30 s")
                    time.sleep(0.005)
                out("OK")
            elif cmd == "SEND":
                agent.send_local_metadata(w[1], int(w[2]))
                out("OK")
            elif cmd == "CHECK":
                deadline = time.monotonic() + float(w[2])
                while not agent.check_remote_metadata(w[1]):
                    if time.monotonic() > deadline:
                        raise RuntimeError("metadata did not arrive")
                    time.sleep(0.005)
                out("OK")
            elif cmd == "HAS":
                out("OK " + str(bool(agent.check_remote_metadata(w[1]))))
            elif cmd == "REMOVE":
                agent.remove_remote_agent(w[1])
                out("OK")
            elif cmd == "POST":
                op, peer, off, n, raddr = w[1], w[2], int(w[3]), int(w[4]), int(w[5])
                local = agent.get_xfer_descs([(base + off, n, 0)], "DRAM")
                remote = agent.get_xfer_descs([(raddr, n, 0)], "DRAM")
                posted[0] = agent.initialize_xfer(op, local, remote, peer)
                out("OK " + agent.transfer(posted[0]))
            elif cmd == "STATE":
                try:
                    out("OK " + agent.check_xfer_state(posted[0]))
                except Exception as e:  # noqa: BLE001 - the class is the answer
                    out(f"OK RAISED {type(e).__name__} {e}".replace("\n", " "))
            elif cmd == "RELEASE":
                agent.release_xfer_handle(posted[0])
                posted[0] = None
                out("OK")
            elif cmd == "EXIT":
                out("OK bye")
                if impl == "nixl":
                    os._exit(0)
                return
            else:
                out("ERR unknown command " + cmd)
        except Exception as e:  # noqa: BLE001 - reported to the test
            out(f"ERR {type(e).__name__}: {e}".replace("\n", " "))


if __name__ == "__main__":
    main()
