"""libibverbs through cffi (ABI mode): the declarations and thin wrappers.

The struct layouts are copied from ``<infiniband/verbs.h>`` (rdma-core),
field by field up to the last field the library touches; the test suite
compiles a C program against the installed header and compares every
``sizeof``/``offsetof`` with cffi's view (``LAYOUT_CHECKS``).

``ibv_post_send``, ``ibv_post_recv`` and ``ibv_poll_cq`` are inline
functions in the header: they call through ``context->ops``, so the
function-pointer table ``struct ibv_context_ops`` is declared exactly.
"""

from __future__ import annotations

import ctypes.util
import os
import threading
from typing import Any

from collectives import config
from ..errors import TransportUnavailable

__all__ = ["CDEF", "LAYOUT_CHECKS", "Verbs", "load", "probe", "VerbsError"]

CDEF = """
typedef struct { long _[5]; } pthread_mutex_t_;  /* pthread_mutex_t on x86-64 glibc: 40 bytes, 8-aligned */
union ibv_gid { uint8_t raw[16]; struct { uint64_t subnet_prefix; uint64_t interface_id; } global; };

struct ibv_device;
struct ibv_srq;
struct ibv_ah;
struct ibv_mw;
struct ibv_comp_channel;
struct ibv_device_attr;
struct _compat_ibv_port_attr;
struct ibv_mw_bind;

struct ibv_pd { struct ibv_context *context; uint32_t handle; };

struct ibv_mr {
    struct ibv_context *context; struct ibv_pd *pd; void *addr; size_t length;
    uint32_t handle; uint32_t lkey; uint32_t rkey;
};

struct ibv_port_attr {
    int state; int max_mtu; int active_mtu; int gid_tbl_len;
    uint32_t port_cap_flags; uint32_t max_msg_sz; uint32_t bad_pkey_cntr; uint32_t qkey_viol_cntr;
    uint16_t pkey_tbl_len; uint16_t lid; uint16_t sm_lid;
    uint8_t lmc; uint8_t max_vl_num; uint8_t sm_sl; uint8_t subnet_timeout; uint8_t init_type_reply;
    uint8_t active_width; uint8_t active_speed; uint8_t phys_state; uint8_t link_layer; uint8_t flags;
    uint16_t port_cap_flags2;
};

struct ibv_global_route {
    union ibv_gid dgid; uint32_t flow_label; uint8_t sgid_index; uint8_t hop_limit; uint8_t traffic_class;
};

struct ibv_ah_attr {
    struct ibv_global_route grh; uint16_t dlid; uint8_t sl; uint8_t src_path_bits;
    uint8_t static_rate; uint8_t is_global; uint8_t port_num;
};

struct ibv_qp_cap {
    uint32_t max_send_wr; uint32_t max_recv_wr; uint32_t max_send_sge; uint32_t max_recv_sge;
    uint32_t max_inline_data;
};

struct ibv_qp_init_attr {
    void *qp_context; struct ibv_cq *send_cq; struct ibv_cq *recv_cq; struct ibv_srq *srq;
    struct ibv_qp_cap cap; int qp_type; int sq_sig_all;
};

struct ibv_qp_attr {
    int qp_state; int cur_qp_state; int path_mtu; int path_mig_state;
    uint32_t qkey; uint32_t rq_psn; uint32_t sq_psn; uint32_t dest_qp_num; unsigned int qp_access_flags;
    struct ibv_qp_cap cap; struct ibv_ah_attr ah_attr; struct ibv_ah_attr alt_ah_attr;
    uint16_t pkey_index; uint16_t alt_pkey_index;
    uint8_t en_sqd_async_notify; uint8_t sq_draining; uint8_t max_rd_atomic; uint8_t max_dest_rd_atomic;
    uint8_t min_rnr_timer; uint8_t port_num; uint8_t timeout; uint8_t retry_cnt; uint8_t rnr_retry;
    uint8_t alt_port_num; uint8_t alt_timeout; uint32_t rate_limit;
};

struct ibv_sge { uint64_t addr; uint32_t length; uint32_t lkey; };

struct ibv_mw_bind_info { struct ibv_mr *mr; uint64_t addr; uint64_t length; unsigned int mw_access_flags; };

struct ibv_send_wr {
    uint64_t wr_id; struct ibv_send_wr *next; struct ibv_sge *sg_list; int num_sge;
    int opcode; unsigned int send_flags;
    union { uint32_t imm_data; uint32_t invalidate_rkey; };
    union {
        struct { uint64_t remote_addr; uint32_t rkey; } rdma;
        struct { uint64_t remote_addr; uint64_t compare_add; uint64_t swap; uint32_t rkey; } atomic;
        struct { struct ibv_ah *ah; uint32_t remote_qpn; uint32_t remote_qkey; } ud;
    } wr;
    union { struct { uint32_t remote_srqn; } xrc; } qp_type;
    union {
        struct { struct ibv_mw *mw; uint32_t rkey; struct ibv_mw_bind_info bind_info; } bind_mw;
        struct { void *hdr; uint16_t hdr_sz; uint16_t mss; } tso;
    };
};

struct ibv_recv_wr { uint64_t wr_id; struct ibv_recv_wr *next; struct ibv_sge *sg_list; int num_sge; };

struct ibv_wc {
    uint64_t wr_id; int status; int opcode; uint32_t vendor_err; uint32_t byte_len;
    union { uint32_t imm_data; uint32_t invalidated_rkey; };
    uint32_t qp_num; uint32_t src_qp; unsigned int wc_flags; uint16_t pkey_index; uint16_t slid;
    uint8_t sl; uint8_t dlid_path_bits;
};

struct ibv_context_ops {
    void *_compat_query_device; void *_compat_query_port; void *_compat_alloc_pd;
    void *_compat_dealloc_pd; void *_compat_reg_mr; void *_compat_rereg_mr; void *_compat_dereg_mr;
    void *alloc_mw; void *bind_mw; void *dealloc_mw; void *_compat_create_cq;
    int (*poll_cq)(struct ibv_cq *cq, int num_entries, struct ibv_wc *wc);
    void *req_notify_cq; void *_compat_cq_event; void *_compat_resize_cq; void *_compat_destroy_cq;
    void *_compat_create_srq; void *_compat_modify_srq; void *_compat_query_srq; void *_compat_destroy_srq;
    void *post_srq_recv; void *_compat_create_qp; void *_compat_query_qp; void *_compat_modify_qp;
    void *_compat_destroy_qp;
    int (*post_send)(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad_wr);
    int (*post_recv)(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad_wr);
    void *_compat_create_ah; void *_compat_destroy_ah; void *_compat_attach_mcast;
    void *_compat_detach_mcast; void *_compat_async_event;
};

struct ibv_context {
    struct ibv_device *device; struct ibv_context_ops ops; int cmd_fd; int async_fd;
    int num_comp_vectors; pthread_mutex_t_ mutex; void *abi_compat;
};

struct ibv_cq {
    struct ibv_context *context; struct ibv_comp_channel *channel; void *cq_context;
    uint32_t handle; int cqe;  /* more fields follow; only this prefix is used */
};

struct ibv_qp {
    struct ibv_context *context; void *qp_context; struct ibv_pd *pd; struct ibv_cq *send_cq;
    struct ibv_cq *recv_cq; struct ibv_srq *srq; uint32_t handle; uint32_t qp_num; int state;
    int qp_type;  /* more fields follow; only this prefix is used */
};

struct ibv_device **ibv_get_device_list(int *num_devices);
void ibv_free_device_list(struct ibv_device **list);
const char *ibv_get_device_name(struct ibv_device *device);
struct ibv_context *ibv_open_device(struct ibv_device *device);
int ibv_close_device(struct ibv_context *context);
int ibv_query_port(struct ibv_context *context, uint8_t port_num, struct ibv_port_attr *port_attr);
int ibv_query_gid(struct ibv_context *context, uint8_t port_num, int index, union ibv_gid *gid);
struct ibv_pd *ibv_alloc_pd(struct ibv_context *context);
int ibv_dealloc_pd(struct ibv_pd *pd);
struct ibv_mr *ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t length, int access);
int ibv_dereg_mr(struct ibv_mr *mr);
struct ibv_cq *ibv_create_cq(struct ibv_context *context, int cqe, void *cq_context,
                             struct ibv_comp_channel *channel, int comp_vector);
int ibv_destroy_cq(struct ibv_cq *cq);
struct ibv_qp *ibv_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *qp_init_attr);
int ibv_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask);
int ibv_destroy_qp(struct ibv_qp *qp);
"""

#: Structs declared only up to the last field used: their sizeof is not compared.
PREFIX_ONLY = frozenset({"struct ibv_cq", "struct ibv_qp"})

#: (C type, fields) whose layout the tests compare with the installed header.
LAYOUT_CHECKS: dict[str, tuple[str, ...]] = {
    "union ibv_gid": ("raw",),
    "struct ibv_pd": ("context", "handle"),
    "struct ibv_mr": ("context", "pd", "addr", "length", "handle", "lkey", "rkey"),
    "struct ibv_port_attr": ("state", "max_mtu", "active_mtu", "gid_tbl_len", "port_cap_flags",
                             "max_msg_sz", "pkey_tbl_len", "lid", "sm_lid", "lmc", "link_layer",
                             "flags", "port_cap_flags2"),
    "struct ibv_global_route": ("dgid", "flow_label", "sgid_index", "hop_limit", "traffic_class"),
    "struct ibv_ah_attr": ("grh", "dlid", "sl", "src_path_bits", "static_rate", "is_global", "port_num"),
    "struct ibv_qp_cap": ("max_send_wr", "max_recv_wr", "max_send_sge", "max_recv_sge", "max_inline_data"),
    "struct ibv_qp_init_attr": ("qp_context", "send_cq", "recv_cq", "srq", "cap", "qp_type", "sq_sig_all"),
    "struct ibv_qp_attr": ("qp_state", "path_mtu", "qkey", "rq_psn", "sq_psn", "dest_qp_num",
                           "qp_access_flags", "cap", "ah_attr", "alt_ah_attr", "pkey_index",
                           "max_rd_atomic", "max_dest_rd_atomic", "min_rnr_timer", "port_num",
                           "timeout", "retry_cnt", "rnr_retry", "rate_limit"),
    "struct ibv_sge": ("addr", "length", "lkey"),
    "struct ibv_send_wr": ("wr_id", "next", "sg_list", "num_sge", "opcode", "send_flags", "imm_data",
                           "wr", "qp_type"),
    "struct ibv_recv_wr": ("wr_id", "next", "sg_list", "num_sge"),
    "struct ibv_wc": ("wr_id", "status", "opcode", "vendor_err", "byte_len", "imm_data", "qp_num",
                      "src_qp", "wc_flags", "pkey_index", "slid", "sl", "dlid_path_bits"),
    "struct ibv_context_ops": ("poll_cq", "post_send", "post_recv", "_compat_async_event"),
    "struct ibv_context": ("device", "ops", "cmd_fd", "async_fd", "num_comp_vectors", "mutex", "abi_compat"),
    "struct ibv_cq": ("context", "channel", "cq_context", "handle", "cqe"),
    "struct ibv_qp": ("context", "qp_context", "pd", "send_cq", "recv_cq", "srq", "handle", "qp_num",
                      "state", "qp_type"),
}

# Constants from verbs.h.
PORT_ACTIVE = 4
QPT_RC = 2
QPS_INIT, QPS_RTR, QPS_RTS = 1, 2, 3
MTU = {256: 1, 512: 2, 1024: 3, 2048: 4, 4096: 5}
ACCESS_LOCAL_WRITE, ACCESS_REMOTE_WRITE, ACCESS_REMOTE_READ = 1, 2, 4
QP_STATE, QP_ACCESS_FLAGS, QP_PKEY_INDEX, QP_PORT = 1 << 0, 1 << 3, 1 << 4, 1 << 5
QP_AV, QP_PATH_MTU, QP_TIMEOUT, QP_RETRY_CNT = 1 << 7, 1 << 8, 1 << 9, 1 << 10
QP_RNR_RETRY, QP_RQ_PSN, QP_MAX_QP_RD_ATOMIC = 1 << 11, 1 << 12, 1 << 13
QP_MIN_RNR_TIMER, QP_SQ_PSN, QP_MAX_DEST_RD_ATOMIC, QP_DEST_QPN = 1 << 15, 1 << 16, 1 << 17, 1 << 20
WR_RDMA_WRITE, WR_RDMA_WRITE_WITH_IMM, WR_SEND = 0, 1, 2
SEND_SIGNALED = 2
WC_SUCCESS = 0
WC_RECV = 1 << 7
WC_RECV_RDMA_WITH_IMM = WC_RECV + 1
LINK_LAYER_ETHERNET = 2


class VerbsError(OSError):
    """A verbs call failed (errno and message)."""


_ffi = None
_lib = None
_lock = threading.Lock()


def ffi() -> Any:
    """The cffi FFI with the verbs declarations (no library needed)."""
    global _ffi
    with _lock:
        if _ffi is None:
            import cffi

            f = cffi.FFI()
            f.cdef(CDEF)
            _ffi = f
    return _ffi


def load() -> Any:
    """dlopen libibverbs; raises TransportUnavailable when it is not installed."""
    global _lib
    f = ffi()
    with _lock:
        if _lib is None:
            name = config.get("IBVERBS") or ctypes.util.find_library("ibverbs")
            if not name:
                raise TransportUnavailable(
                    "libibverbs is not installed (Debian/Ubuntu: apt-get install rdma-core "
                    "ibverbs-providers libibverbs1)")
            try:
                _lib = f.dlopen(name)
            except OSError as exc:
                raise TransportUnavailable(f"libibverbs could not be loaded: {exc}") from exc
    return _lib


def probe(device: str | None = None) -> tuple[bool, str]:
    """(True, "device:port") when an RDMA port is active, else (False, why).

    The reasons are distinct: no library, the kernel has no RDMA support
    (``ibv_get_device_list`` fails with ENOSYS), no devices, the named
    device is absent, no active port.
    """
    try:
        lib = load()
    except TransportUnavailable as exc:
        return False, str(exc)
    f = ffi()
    num = f.new("int *", 0)
    lst = lib.ibv_get_device_list(num)
    if lst == f.NULL:
        err = f.errno
        if err == 38:
            return False, ("the kernel has no RDMA support: ibv_get_device_list failed with ENOSYS "
                           "(no ib_uverbs; load the RDMA kernel modules or use another transport)")
        return False, f"ibv_get_device_list failed: {os.strerror(err)} (errno {err})"
    try:
        names = [f.string(lib.ibv_get_device_name(lst[i])).decode() for i in range(num[0])]
        if not names:
            return False, "no RDMA devices are present (ibv_get_device_list returned none)"
        if device is not None and device not in names:
            return False, f"RDMA device {device!r} not found (present: {', '.join(names)})"
        for i, name in enumerate(names):
            if device is not None and name != device:
                continue
            port = _first_active_port(lib, f, lst[i])
            if port:
                return True, f"{name}:{port}"
        return False, f"no active port on RDMA device(s) {', '.join(names)}"
    finally:
        lib.ibv_free_device_list(lst)


def _first_active_port(lib: Any, f: Any, dev: Any, max_ports: int = 8) -> int:
    ctx = lib.ibv_open_device(dev)
    if ctx == f.NULL:
        return 0
    try:
        attr = f.new("struct ibv_port_attr *")
        for port in range(1, max_ports + 1):
            if lib.ibv_query_port(ctx, port, attr) != 0:
                break
            if attr.state == PORT_ACTIVE:
                return port
        return 0
    finally:
        lib.ibv_close_device(ctx)


class Verbs:
    """One opened device: its context, port, protection domain and completion queue."""

    def __init__(self, device: str | None = None, cq_entries: int = 4096) -> None:
        ok, where = probe(device)
        if not ok:
            raise TransportUnavailable(where)
        self.lib, self.ffi = load(), ffi()
        name, port = where.rsplit(":", 1)
        self.device_name, self.port = name, int(port)
        self.ctx = self._open(name)
        self.port_attr = self.ffi.new("struct ibv_port_attr *")
        self._check(self.lib.ibv_query_port(self.ctx, self.port, self.port_attr), "ibv_query_port")
        self.gid = self.ffi.new("union ibv_gid *")
        self.gid_index = config.get("IB_GID_INDEX")
        self._check(self.lib.ibv_query_gid(self.ctx, self.port, self.gid_index, self.gid), "ibv_query_gid")
        self.pd = self._nonnull(self.lib.ibv_alloc_pd(self.ctx), "ibv_alloc_pd")
        self.cq = self._nonnull(self.lib.ibv_create_cq(self.ctx, cq_entries, self.ffi.NULL, self.ffi.NULL, 0),
                                "ibv_create_cq")
        self._poll = self.ctx.ops.poll_cq

    def _open(self, name: str) -> Any:
        num = self.ffi.new("int *", 0)
        lst = self.lib.ibv_get_device_list(num)
        try:
            for i in range(num[0]):
                if self.ffi.string(self.lib.ibv_get_device_name(lst[i])).decode() == name:
                    return self._nonnull(self.lib.ibv_open_device(lst[i]), "ibv_open_device")
        finally:
            self.lib.ibv_free_device_list(lst)
        raise TransportUnavailable(f"RDMA device {name} disappeared")

    def _check(self, rc: int, call: str) -> None:
        if rc != 0:
            err = rc if rc > 0 else self.ffi.errno
            raise VerbsError(err, f"{call}: {os.strerror(err)}")

    def _nonnull(self, ptr: Any, call: str) -> Any:
        if ptr == self.ffi.NULL:
            err = self.ffi.errno
            raise VerbsError(err, f"{call}: {os.strerror(err)}")
        return ptr

    @property
    def is_ethernet(self) -> bool:
        """RoCE ports are addressed by GID, InfiniBand ports by LID."""
        return self.port_attr.link_layer == LINK_LAYER_ETHERNET

    def reg_mr(self, addr: int, nbytes: int) -> Any:
        access = ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE | ACCESS_REMOTE_READ
        return self._nonnull(self.lib.ibv_reg_mr(self.pd, self.ffi.cast("void *", addr), nbytes, access),
                             "ibv_reg_mr")

    def dereg_mr(self, mr: Any) -> None:
        self._check(self.lib.ibv_dereg_mr(mr), "ibv_dereg_mr")

    def create_rc_qp(self, max_send: int = 256, max_recv: int = 256) -> Any:
        init = self.ffi.new("struct ibv_qp_init_attr *")
        init.send_cq = init.recv_cq = self.cq
        init.cap.max_send_wr, init.cap.max_recv_wr = max_send, max_recv
        init.cap.max_send_sge = init.cap.max_recv_sge = 2
        init.qp_type = QPT_RC
        qp = self._nonnull(self.lib.ibv_create_qp(self.pd, init), "ibv_create_qp")
        attr = self.ffi.new("struct ibv_qp_attr *")
        attr.qp_state, attr.pkey_index, attr.port_num = QPS_INIT, 0, self.port
        attr.qp_access_flags = ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE | ACCESS_REMOTE_READ
        self._check(self.lib.ibv_modify_qp(qp, attr, QP_STATE | QP_PKEY_INDEX | QP_PORT | QP_ACCESS_FLAGS),
                    "ibv_modify_qp(INIT)")
        return qp

    def address(self, qp: Any) -> dict[str, Any]:
        """What a peer needs to connect to ``qp``: LID, GID, QP number, PSN."""
        return {"lid": int(self.port_attr.lid), "gid": bytes(self.ffi.buffer(self.gid.raw, 16)).hex(),
                "qpn": int(qp.qp_num), "psn": 0, "mtu": int(self.port_attr.active_mtu)}

    def connect(self, qp: Any, remote: dict[str, Any]) -> None:
        """Move ``qp`` through RTR and RTS towards ``remote`` (its :meth:`address`)."""
        attr = self.ffi.new("struct ibv_qp_attr *")
        attr.qp_state = QPS_RTR
        attr.path_mtu = min(int(remote["mtu"]), int(self.port_attr.active_mtu))
        attr.dest_qp_num, attr.rq_psn = int(remote["qpn"]), int(remote["psn"])
        attr.max_dest_rd_atomic, attr.min_rnr_timer = 1, 12
        attr.ah_attr.dlid, attr.ah_attr.port_num = int(remote["lid"]), self.port
        if self.is_ethernet:
            attr.ah_attr.is_global = 1
            self.ffi.memmove(attr.ah_attr.grh.dgid.raw, bytes.fromhex(remote["gid"]), 16)
            attr.ah_attr.grh.sgid_index, attr.ah_attr.grh.hop_limit = self.gid_index, 64
        mask = (QP_STATE | QP_AV | QP_PATH_MTU | QP_DEST_QPN | QP_RQ_PSN | QP_MAX_DEST_RD_ATOMIC
                | QP_MIN_RNR_TIMER)
        self._check(self.lib.ibv_modify_qp(qp, attr, mask), "ibv_modify_qp(RTR)")
        attr = self.ffi.new("struct ibv_qp_attr *")
        attr.qp_state, attr.sq_psn, attr.timeout, attr.retry_cnt = QPS_RTS, 0, 14, 7
        attr.rnr_retry, attr.max_rd_atomic = 7, 1  # 7: retry forever when the peer has no receive posted
        mask = QP_STATE | QP_SQ_PSN | QP_TIMEOUT | QP_RETRY_CNT | QP_RNR_RETRY | QP_MAX_QP_RD_ATOMIC
        self._check(self.lib.ibv_modify_qp(qp, attr, mask), "ibv_modify_qp(RTS)")

    def post_send(self, qp: Any, wr: Any) -> None:
        bad = self.ffi.new("struct ibv_send_wr **")
        self._check(qp.context.ops.post_send(qp, wr, bad), "ibv_post_send")

    def post_recv(self, qp: Any, wr: Any) -> None:
        bad = self.ffi.new("struct ibv_recv_wr **")
        self._check(qp.context.ops.post_recv(qp, wr, bad), "ibv_post_recv")

    def poll(self, wcs: Any, n: int) -> int:
        """Poll up to ``n`` completions into ``wcs``; returns how many."""
        got = self._poll(self.cq, n, wcs)
        if got < 0:
            raise VerbsError(0, "ibv_poll_cq failed")
        return got

    def destroy_qp(self, qp: Any) -> None:
        self.lib.ibv_destroy_qp(qp)

    def close(self) -> None:
        if self.ctx is None:
            return
        self.lib.ibv_destroy_cq(self.cq)
        self.lib.ibv_dealloc_pd(self.pd)
        self.lib.ibv_close_device(self.ctx)
        self.ctx = None
