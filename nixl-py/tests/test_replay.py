"""The call sequences of the two big NIXL users, replayed on DRAM with bytes and
notifications checked:

- vLLM's NixlConnector (decode pulls the prefill's KV blocks: READ, prepared lists,
  numpy block ids, a notification per request telling the prefill to free them);
- SGLang's NIXL disaggregation (prefill pushes KV and aux data into the decode's
  memory: WRITE via initialize_xfer, notifications "<room>_kv_<chunk>_<last>_<pp>"
  and "<room>_aux").

Each runs on TCP, and on UCX where libucp is installed.
"""

import uuid

import pytest
from conftest import HANG, addr, np, system_ucx, wait_for

from nixl_rs._api import nixl_agent, nixl_agent_config

BACKENDS = [["TCP"], pytest.param(["UCX"], marks=pytest.mark.skipif(
    not system_ucx(), reason="libucp.so.0 not found (apt-get install libucx0)"))]

NUM_LAYERS, NUM_BLOCKS, BLOCK_LEN = 4, 32, 4096


class VllmWorker:
    """What NixlConnectorWorker does with its NixlWrapper."""

    def __init__(self, backends, seed):
        config = nixl_agent_config(backends=backends, capture_telemetry=True)
        self.nixl_wrapper = nixl_agent(str(uuid.uuid4()), config)
        self.nixl_backends = backends
        self.nixl_memory_type = "DRAM"
        # One KV region per layer (torch tensors in vLLM; numpy here).
        self.kv_caches = [np.random.default_rng(seed + i).integers(0, 255, NUM_BLOCKS * BLOCK_LEN,
                                                                   dtype=np.uint8)
                          for i in range(NUM_LAYERS)]
        self._registered_descs = []
        self.dst_xfer_side_handles = {}
        self._recving_transfers = {}
        self._remote_agents = {}

    def register_kv_caches(self, tp_rank=0):
        caches_data = [(c.ctypes.data, c.nbytes, tp_rank, "") for c in self.kv_caches]
        descs = self.nixl_wrapper.get_reg_descs(caches_data, self.nixl_memory_type)
        self.nixl_wrapper.register_memory(descs, backends=self.nixl_backends)
        self._registered_descs.append(descs)
        self.kv_caches_base_addr = [c.ctypes.data for c in self.kv_caches]
        blocks_data = [(base + b * BLOCK_LEN, BLOCK_LEN, tp_rank)
                       for base in self.kv_caches_base_addr for b in range(NUM_BLOCKS)]
        descs = self.nixl_wrapper.get_xfer_descs(blocks_data, self.nixl_memory_type)
        self.src_xfer_side_handle = self.nixl_wrapper.prep_xfer_dlist("NIXL_INIT_AGENT", descs)

    def metadata(self):
        """NixlAgentMetadata, sent over vLLM's side channel (zmq + msgspec)."""
        return dict(engine_id="prefill", agent_metadata=self.nixl_wrapper.get_agent_metadata(),
                    kv_caches_base_addr=self.kv_caches_base_addr, num_blocks=NUM_BLOCKS,
                    block_len=BLOCK_LEN)

    def add_remote_agent(self, meta, tp_rank=0):
        engine_id = meta["engine_id"]
        remote_agent_name = self.nixl_wrapper.add_remote_agent(meta["agent_metadata"])
        self._remote_agents[engine_id] = remote_agent_name
        blocks_data = [(base + b * meta["block_len"], meta["block_len"], tp_rank)
                       for base in meta["kv_caches_base_addr"] for b in range(meta["num_blocks"])]
        descs = self.nixl_wrapper.get_xfer_descs(blocks_data, self.nixl_memory_type)
        self.dst_xfer_side_handles[engine_id] = self.nixl_wrapper.prep_xfer_dlist(
            remote_agent_name, descs)
        return remote_agent_name

    def _get_block_descs_ids(self, block_ids):
        region_ids = np.arange(NUM_LAYERS)[:, None]
        return (region_ids * NUM_BLOCKS + np.asarray(block_ids)[None, :]).flatten()

    def read_blocks(self, local_block_ids, remote_block_ids, dst_engine_id, request_id):
        notif_id = f"{request_id}:1".encode()
        if len(local_block_ids) == 0:
            self.nixl_wrapper.send_notif(self._remote_agents[dst_engine_id], notif_msg=notif_id)
            return
        local_ids = self._get_block_descs_ids(local_block_ids)
        remote_ids = self._get_block_descs_ids(remote_block_ids)
        handle = self.nixl_wrapper.make_prepped_xfer(
            "READ", self.src_xfer_side_handle, local_ids,
            self.dst_xfer_side_handles[dst_engine_id], remote_ids, notif_msg=notif_id)
        self.nixl_wrapper.transfer(handle)
        self._recving_transfers.setdefault(request_id, []).append(handle)

    def pop_done_transfers(self):
        done = set()
        for req_id, handles in list(self._recving_transfers.items()):
            in_progress = False
            for handle in handles:
                xfer_state = self.nixl_wrapper.check_xfer_state(handle)
                if xfer_state == "DONE":
                    res = self.nixl_wrapper.get_xfer_telemetry(handle)
                    assert res.totalBytes > 0 and res.xferDuration >= res.postDuration
                    self.nixl_wrapper.release_xfer_handle(handle)
                elif xfer_state == "PROC":
                    in_progress = True
                    continue
                else:
                    raise RuntimeError("Transfer failed with state %s", xfer_state)
            if not in_progress:
                done.add(req_id)
                del self._recving_transfers[req_id]
        return done

    def get_finished_sending(self):
        """The prefill: requests whose blocks the decode has read."""
        notified = set()
        for notifs in self.nixl_wrapper.get_new_notifs().values():
            for notif in notifs:
                req_id, tp_ratio = notif.decode("utf-8").rsplit(":", 1)
                notified.add(req_id)
        return notified

    def shutdown(self):
        for handles in self._recving_transfers.values():
            for handle in handles:
                self.nixl_wrapper.release_xfer_handle(handle)
        self.nixl_wrapper.release_dlist_handle(self.src_xfer_side_handle)
        for dst in self.dst_xfer_side_handles.values():
            self.nixl_wrapper.release_dlist_handle(dst)
        for agent in self._remote_agents.values():
            self.nixl_wrapper.remove_remote_agent(agent)
        for desc in self._registered_descs:
            self.nixl_wrapper.deregister_memory(desc)
        self.nixl_wrapper.shutdown()


@pytest.mark.parametrize("backends", BACKENDS)
def test_vllm_nixl_connector_pull(backends):
    prefill, decode = VllmWorker(backends, 10), VllmWorker(backends, 20)
    prefill.register_kv_caches()
    decode.register_kv_caches()
    decode.add_remote_agent(prefill.metadata())
    # Three requests: blocks moved between different ids; one with nothing to read.
    reqs = {"req-a": ([0, 1, 2, 3], [10, 11, 12, 13]),
            "req-b": ([7, 5], [30, 2]),
            "req-c": ([], [])}
    for req_id, (local, remote) in reqs.items():
        decode.read_blocks(local, remote, "prefill", req_id)
    done, notified = set(), set()

    def step():
        done.update(decode.pop_done_transfers())
        notified.update(prefill.get_finished_sending())
        return done >= {"req-a", "req-b"} and notified == set(reqs)

    wait_for(step, "every request read and notified", HANG)
    for local, remote in reqs.values():
        for layer in range(NUM_LAYERS):
            for lb, rb in zip(local, remote):
                got = decode.kv_caches[layer][lb * BLOCK_LEN:(lb + 1) * BLOCK_LEN]
                want = prefill.kv_caches[layer][rb * BLOCK_LEN:(rb + 1) * BLOCK_LEN]
                assert (got == want).all(), (layer, lb, rb)
    decode.shutdown()
    prefill.shutdown()


class SglangManager:
    """What NixlKVManager (sender and receiver) does with its agent."""

    def __init__(self, backends, kv_len, aux_len):
        self.agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config(backends=backends))
        self.kv = np.zeros(kv_len, dtype=np.uint8)
        self.aux = np.zeros(aux_len, dtype=np.uint8)
        self.gpu_id = 0
        self.register_buffer_to_engine()

    def register_buffer_to_engine(self):
        kv_addrs = [(self.kv.ctypes.data, self.kv.nbytes, self.gpu_id, "")]
        self.kv_descs = self.agent.register_memory(kv_addrs, "DRAM")  # "VRAM" on GPUs
        assert self.kv_descs is not None
        aux_addrs = [(self.aux.ctypes.data, self.aux.nbytes, 0, "")]
        self.aux_descs = self.agent.register_memory(aux_addrs, "DRAM")
        assert self.aux_descs is not None

    def send_kvcache(self, peer_name, prefill_kv_indices, dst_kv_ptr, dst_kv_indices,
                     item_len, notif):
        src_addrs = np.array([(self.kv.ctypes.data + i * item_len, item_len, self.gpu_id)
                              for i in prefill_kv_indices], dtype=np.uint64)
        dst_addrs = np.array([(dst_kv_ptr + i * item_len, item_len, self.gpu_id)
                              for i in dst_kv_indices], dtype=np.uint64)
        src_descs = self.agent.get_xfer_descs(src_addrs, "DRAM")
        dst_descs = self.agent.get_xfer_descs(dst_addrs, "DRAM")
        xfer_handle = self.agent.initialize_xfer("WRITE", src_descs, dst_descs, peer_name,
                                                 notif.encode("ascii"))
        if not xfer_handle:
            raise Exception("KVSender failed to create transfer")
        state = self.agent.transfer(xfer_handle)
        if state == "ERR":
            raise Exception("KVSender failed to post transfer")
        return xfer_handle

    def send_aux(self, peer_name, dst_aux_ptr, room):
        src = self.agent.get_xfer_descs([(self.aux.ctypes.data, self.aux.nbytes, 0)], "DRAM")
        dst = self.agent.get_xfer_descs([(dst_aux_ptr, self.aux.nbytes, 0)], "DRAM")
        handle = self.agent.initialize_xfer("WRITE", src, dst, peer_name,
                                            f"{room}_aux".encode("ascii"))
        self.agent.transfer(handle)
        return handle


@pytest.mark.parametrize("backends", BACKENDS)
def test_sglang_nixl_push(backends):
    item_len, items = 2048, 64
    prefill = SglangManager(backends, item_len * items, 512)
    decode = SglangManager(backends, item_len * items, 512)
    prefill.kv[:] = np.random.default_rng(5).integers(0, 255, prefill.kv.nbytes, dtype=np.uint8)
    prefill.aux[:] = 0x5A
    # The decode registers its buffers and sends its metadata and pointers (zmq).
    peer_name = prefill.agent.add_remote_agent(decode.agent.get_agent_metadata())
    assert peer_name == decode.agent.name.encode()
    room = 4242
    chunks = [(list(range(0, 16)), list(range(48, 64))), (list(range(16, 20)), [1, 3, 5, 7])]
    handles = []
    for chunk_id, (src_idx, dst_idx) in enumerate(chunks):
        is_last = chunk_id == len(chunks) - 1
        notif = f"{room}_kv_{chunk_id}_{int(is_last)}_0"
        handles.append(prefill.send_kvcache(peer_name, src_idx, decode.kv.ctypes.data, dst_idx,
                                            item_len, notif))
    handles.append(prefill.send_aux(peer_name, decode.aux.ctypes.data, room))

    def all_done():
        states = [prefill.agent.check_xfer_state(h) for h in handles]
        if "ERR" in states:
            raise Exception("KVSender transfer encountered an error.")
        return all(s == "DONE" for s in states)

    wait_for(all_done, "the pushes")
    # The decode collects notifications as SGLang's receiver does.
    seen = {}

    def collect():
        for agent_name, msgs in decode.agent.get_new_notifs().items():
            assert agent_name == prefill.agent.name
            for msg in msgs:
                parts = msg.decode("ascii").split("_")
                seen[tuple(parts[1:])] = int(parts[0])
        return len(seen) == 3

    wait_for(collect, "kv and aux notifications")
    assert seen == {("kv", "0", "0", "0"): room, ("kv", "1", "1", "0"): room, ("aux",): room}
    for src_idx, dst_idx in chunks:
        for s, d in zip(src_idx, dst_idx):
            assert (decode.kv[d * item_len:(d + 1) * item_len]
                    == prefill.kv[s * item_len:(s + 1) * item_len]).all()
    assert (decode.aux == 0x5A).all()
    for h in handles:
        prefill.agent.release_xfer_handle(h)
    prefill.agent.deregister_memory(prefill.kv_descs)
    decode.agent.deregister_memory(decode.kv_descs)
    prefill.agent.shutdown()
    decode.agent.shutdown()
