"""A real NIXL agent (the `nixl-cu12` wheel's Python API) driven line by line, for the
interop tests in tests/tests/nixl_interop.rs.

Usage: nixl_peer.py NAME BUFFER_BYTES [LISTEN_PORT]

Reads one command per line on stdin and answers each with one line on stdout that
starts with "@@ OK" or "@@ ERR" (NIXL's own logging goes to stderr). Byte strings
travel as hex ("-" is empty). The agent owns one registered DRAM buffer.

  ADDR                          -> address and length of the buffer
  MD                            -> the agent's full metadata
  PARTIAL CONN                  -> partial metadata of the buffer (CONN 1: with conn info)
  LOAD HEX                      -> add_remote_agent; the peer's name
  REMOVE NAME                   -> remove_remote_agent
  FILL OFF LEN BYTE             -> set buffer bytes
  DUMP OFF LEN                  -> buffer bytes
  XFER OP PEER OFF LEN RADDR NOTIF
                                -> READ/WRITE LEN bytes between buffer+OFF and the
                                   peer's RADDR, with a notification, waited for
  POST OP PEER OFF LEN RADDR    -> start a transfer without waiting (for kill tests)
  NOTIF PEER HEX                -> send_notif
  NOTIFS COUNT TIMEOUT_S        -> wait for COUNT notifications: "peer:hex ..."
  FETCH PEER IP PORT            -> fetch_remote_metadata, then wait for check_remote_metadata
  SENDMD IP PORT                -> send_local_metadata
  INVAL IP PORT                 -> invalidate_local_metadata to a peer
  CHECK PEER TIMEOUT_S          -> wait until check_remote_metadata(PEER)
  GONE PEER TIMEOUT_S           -> wait until not check_remote_metadata(PEER)
  EPUB                          -> send_local_metadata() to etcd (NIXL_ETCD_ENDPOINTS set)
  EFETCH PEER                   -> fetch_remote_metadata(PEER) from etcd, waited for
  EINVAL                        -> invalidate_local_metadata() in etcd
  EXIT                          -> os._exit(0) (the wheel may crash in its own exit path)
"""

import os
import sys
import time

import numpy as np
from nixl_cu12._api import nixl_agent, nixl_agent_config


def hx(b):
    return b.hex() if b else "-"


def unhx(s):
    return b"" if s == "-" else bytes.fromhex(s)


def main():
    name, size = sys.argv[1], int(sys.argv[2])
    port = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    if port:
        cfg = nixl_agent_config(
            enable_listen_thread=True, listen_port=port, backends=["UCX"]
        )
    else:
        cfg = nixl_agent_config(backends=["UCX"])
    agent = nixl_agent(name, cfg)
    buf = np.zeros(size, dtype=np.uint8)
    addr = buf.ctypes.data
    reg = agent.get_reg_descs([(addr, size, 0, "")], "DRAM")
    agent.register_memory(reg)
    pending = []
    notifs = []

    def out(line):
        sys.stdout.write("@@ " + line + "\n")
        sys.stdout.flush()

    def collect():
        for peer, msgs in agent.get_new_notifs().items():
            for m in msgs:
                notifs.append((peer, m))

    out("OK ready %d %d" % (addr, size))
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        cmd, args = words[0], words[1:]
        try:
            if cmd == "ADDR":
                out("OK %d %d" % (addr, size))
            elif cmd == "MD":
                out("OK " + hx(agent.get_agent_metadata()))
            elif cmd == "PARTIAL":
                md = agent.get_partial_agent_metadata(reg, args[0] == "1", ["UCX"])
                out("OK " + hx(md))
            elif cmd == "LOAD":
                peer = agent.add_remote_agent(unhx(args[0]))
                out("OK " + (peer.decode() if isinstance(peer, bytes) else str(peer)))
            elif cmd == "REMOVE":
                agent.remove_remote_agent(args[0])
                out("OK")
            elif cmd == "FILL":
                off, n, v = int(args[0]), int(args[1]), int(args[2])
                buf[off:off + n] = v
                out("OK")
            elif cmd == "DUMP":
                off, n = int(args[0]), int(args[1])
                out("OK " + hx(buf[off:off + n].tobytes()))
            elif cmd in ("XFER", "POST"):
                op, peer = args[0], args[1]
                off, n, raddr = int(args[2]), int(args[3]), int(args[4])
                notif = unhx(args[5]) if len(args) > 5 else b""
                local = agent.get_xfer_descs([(addr + off, n, 0)], "DRAM")
                remote = agent.get_xfer_descs([(raddr, n, 0)], "DRAM")
                h = agent.initialize_xfer(op, local, remote, peer, notif)
                state = agent.transfer(h)
                if cmd == "POST":
                    pending.append(h)
                    out("OK " + state)
                    continue
                deadline = time.time() + 20
                while state == "PROC" and time.time() < deadline:
                    state = agent.check_xfer_state(h)
                agent.release_xfer_handle(h)
                out(("OK " if state == "DONE" else "ERR ") + state)
            elif cmd == "NOTIF":
                agent.send_notif(args[0], unhx(args[1]))
                out("OK")
            elif cmd == "NOTIFS":
                count, deadline = int(args[0]), time.time() + float(args[1])
                collect()
                while len(notifs) < count and time.time() < deadline:
                    time.sleep(0.001)
                    collect()
                got, notifs[:] = notifs[:count], notifs[count:]
                words = " ".join("%s:%s" % (p, hx(m)) for p, m in got)
                out(("OK " if len(got) == count else "ERR ") + str(len(got)) + " " + words)
            elif cmd == "FETCH":
                agent.fetch_remote_metadata(args[0], args[1], int(args[2]))
                deadline = time.time() + 20
                while not agent.check_remote_metadata(args[0]) and time.time() < deadline:
                    time.sleep(0.01)
                out("OK" if agent.check_remote_metadata(args[0]) else "ERR not loaded")
            elif cmd == "SENDMD":
                agent.send_local_metadata(args[0], int(args[1]))
                out("OK")
            elif cmd == "INVAL":
                agent.invalidate_local_metadata(args[0], int(args[1]))
                out("OK")
            elif cmd in ("CHECK", "GONE"):
                want = cmd == "CHECK"
                deadline = time.time() + float(args[1])
                while agent.check_remote_metadata(args[0]) != want and time.time() < deadline:
                    time.sleep(0.01)
                ok = agent.check_remote_metadata(args[0]) == want
                out("OK" if ok else "ERR timeout")
            elif cmd == "EPUB":
                agent.send_local_metadata()
                out("OK")
            elif cmd == "EFETCH":
                agent.fetch_remote_metadata(args[0])
                deadline = time.time() + 20
                while not agent.check_remote_metadata(args[0]) and time.time() < deadline:
                    time.sleep(0.01)
                out("OK" if agent.check_remote_metadata(args[0]) else "ERR not loaded")
            elif cmd == "EINVAL":
                agent.invalidate_local_metadata()
                out("OK")
            elif cmd == "EXIT":
                out("OK")
                os._exit(0)
            else:
                out("ERR unknown command " + cmd)
        except Exception as e:  # report, keep serving
            out("ERR %s: %s" % (type(e).__name__, str(e).replace("\n", " ")))
    os._exit(0)


if __name__ == "__main__":
    main()
