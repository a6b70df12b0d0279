"""`zaya diagnose`: the root cause of an incident is its earliest root line, never its loudest cascade.

The logs are in the formats the real emitters print: the NVIDIA driver's Xid lines, NCCL/RCCL's NET/IB
warnings, PyTorch's ProcessGroupNCCL watchdog and torchrun's failure summary, the amdgpu driver and ROCr,
Linux AER, the OOM killer, EDAC and file systems, with the noise around them (NCCL INFO, metrics lines).
"""

from __future__ import annotations

import json
import re
import textwrap
import time
from dataclasses import dataclass

import pytest
from click.testing import CliRunner

from zaya.errors import ZayaError
from zaya.resilience.diagnose import (
    ROOT_CLASSES,
    XID_MEANINGS,
    Diagnosis,
    _Classifier,
    classify_files,
    classify_lines,
    classify_text,
)
from zaya.resilience.diagnose_cli import diagnose
from zaya.resilience.findings import Finding
from zaya.resilience.signatures import _RULES, _SEPARATORS, COURSE, _triggered


def text(block: str) -> str:
    return textwrap.dedent(block).strip("\n")


def log(*lines: str) -> str:
    return "\n".join(lines)


# ---- the pieces real incidents are made of ------------------------------------------------------------

NOISE = log(
    "node0:4321:4321 [0] NCCL INFO Bootstrap : Using ib0:10.0.0.1<0>",
    "node0:4321:4321 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB ib0:10.0.0.1<0>",
    "node0:4321:4399 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC/read",
    "node0:4321:4399 [0] NCCL INFO NCCL_IB_TIMEOUT set by environment to 22.",
    "step 118 | loss 2.9131 | lr 3.00e-04 | grad_norm 0.412 | tok/s 412,331 | mfu 41.2%",
    "step 119 | loss 2.9087 | lr 3.00e-04 | grad_norm 0.398 | tok/s 413,002 | mfu 41.3%",
)

_WORK = "WorkNCCL(SeqNum=1204, OpType=ALLREDUCE, NumelIn=131072, NumelOut=131072, Timeout(ms)=600000)"
WATCHDOG = log(
    "[rank3]:[E1201 10:10:01.123456789 ProcessGroupNCCL.cpp:616] [Rank 3] Watchdog caught collective operation "
    f"timeout: {_WORK} ran for 600012 milliseconds before timing out.",
    "[rank3]:[E1201 10:10:01.124000000 ProcessGroupNCCL.cpp:1785] [PG ID 0 PG GUID 0(default_pg) Rank 3] Exception "
    "(either an error or timeout) detected by watchdog at work: 1204, last enqueued NCCL work: 1204, last "
    "completed NCCL work: 1203.",
    "[rank3]:[E1201 10:10:01.124100000 ProcessGroupNCCL.cpp:630] [Rank 3] Some NCCL operations have failed or timed "
    "out. Due to the asynchronous nature of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete "
    "data.",
    "[rank3]:[E1201 10:10:01.124200000 ProcessGroupNCCL.cpp:636] [Rank 3] To avoid data inconsistency, we are taking "
    "the entire process down.",
    "[rank3]:[E1201 10:10:01.125000000 ProcessGroupNCCL.cpp:1595] [PG ID 0 PG GUID 0(default_pg) Rank 3] Process "
    f"group watchdog thread terminated with exception: [Rank 3] Watchdog caught collective operation timeout: {_WORK} "
    "ran for 600012 milliseconds before timing out.",
    "terminate called after throwing an instance of 'c10::DistBackendError'",
    "[rank2]:[E1201 10:10:02.000000000 ProcessGroupNCCL.cpp:1414] [PG ID 0 PG GUID 0(default_pg) Rank 2] Heartbeat "
    "monitor timed out! Process will be terminated after dumping debug info. workMetaList_.size()=1",
)

_ELASTIC = "torch/distributed/elastic/multiprocessing/api.py"
TORCHRUN_SUMMARY = log(
    f"W1201 10:10:05.123000 4242 {_ELASTIC}:897] Sending process 4301 closing signal SIGTERM",
    f"E1201 10:10:06.456000 4242 {_ELASTIC}:869] failed (exitcode: -6) local_rank: 3 (pid: 4304) of binary: "
    "/usr/bin/python3",
    text("""
        Traceback (most recent call last):
          File "/usr/local/bin/torchrun", line 8, in <module>
            sys.exit(main())
          File "/usr/local/lib/python3.11/site-packages/torch/distributed/run.py", line 919, in main
            run(args)
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
        ============================================================
        train.py FAILED
        ------------------------------------------------------------
        Failures:
        [1]:
          time      : 2024-12-01_10:10:05
          host      : node0
          rank      : 0 (local_rank: 0)
          exitcode  : -15 (pid: 4301)
          error_file: <N/A>
          traceback : Signal 15 (SIGTERM) received by PID 4301
        ------------------------------------------------------------
        Root Cause (first observed failure):
        [0]:
          time      : 2024-12-01_10:10:05
          host      : node0
          rank      : 3 (local_rank: 3)
          exitcode  : -6 (pid: 4304)
          error_file: <N/A>
          traceback : Signal 6 (SIGABRT) received by PID 4304
        ============================================================
        """),
)

XID_79 = ("Dec 01 10:00:12 gpu-node-07 kernel: [86400.123789] NVRM: Xid (PCI:0000:3b:00): 79, pid=48213, name=python, "
          "GPU has fallen off the bus.")

OOM_TRACEBACK = log(
    "[rank1]: Traceback (most recent call last):",
    '[rank1]:   File "/workspace/train.py", line 88, in <module>',
    "[rank1]:     loss.backward()",
    '[rank1]:   File "/usr/lib/python3.11/site-packages/torch/_tensor.py", line 581, in backward',
    "[rank1]:     torch.autograd.backward(",
    "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of "
    "79.15 GiB of which 1.06 GiB is free. Including non-PyTorch memory, this process has 78.08 GiB memory in use. Of "
    "the allocated memory 74.10 GiB is allocated by PyTorch, and 2.51 GiB is reserved by PyTorch but unallocated.",
)


@dataclass(frozen=True)
class Case:
    id: str
    log: str
    root: str
    line: str = ""  # a fragment of the evidence line ("" for unknown)
    detail: str = ""  # a fragment of the detail
    subject: str | None = None  # the exact subject, when the case pins it
    cascade: int = 0  # at least this many cascade lines


CASES = [
    # -- gpu_xid --
    Case("xid79-then-watchdogs",
         log(NOISE, XID_79, "Dec 01 10:00:12 gpu-node-07 kernel: NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.",
             WATCHDOG, TORCHRUN_SUMMARY),
         "gpu_xid", ": 79, pid=48213", "Xid 79: GPU has fallen off the bus", "pci:0000:3b:00", cascade=10),
    Case("watchdogs-then-xid", log(WATCHDOG, NOISE, XID_79), "gpu_xid", ": 79,", "Xid 79", "pci:0000:3b:00", 7),
    Case("xid48-with-function-no-pid",
         log("[  812.345678] NVRM: Xid (PCI:0000:3b:00.0): 48, An uncorrectable double bit error (DBE) has been "
             "detected on GPU in the framebuffer at partition 6, subpartition 0.",
             "[  812.345700] NVRM: Xid (PCI:0000:3b:00.0): 45, pid=2211, name=python, Ch 00000008"),
         "gpu_xid", ": 48, An uncorrectable", "Xid 48: Double Bit ECC Error", "pci:0000:3b:00"),
    Case("xid45-first-is-not-the-root",
         log("Dec 01 10:00:00 node3 kernel: NVRM: Xid (PCI:0000:5e:00): 45, pid=1234, name=python, Ch 00000008",
             "Dec 01 10:00:01 node3 kernel: NVRM: Xid (PCI:0000:5e:00): 94, pid=1234, name=python, Contained: SM "
             "(0x1). RST: No, D-RST: No"),
         "gpu_xid", ": 94,", "Xid 94: Contained ECC error", "pci:0000:5e:00"),
    Case("xid45-alone", "Dec 01 10:00:00 node3 kernel: NVRM: Xid (PCI:0000:5e:00): 45, pid=1234, name=python, Ch 0008",
         "gpu_xid", ": 45,", "Xid 45: Preemptive cleanup, due to previous errors"),
    Case("xid13-mig",
         "[ 42.000001] NVRM: Xid (PCI:0000:17:00 GPU-I:05): 13, pid=2345, name=python, Graphics SM Warp Exception on "
         "(GPC 1, TPC 0, SM 0): Out Of Range Address",
         "gpu_xid", "GPU-I:05", "Xid 13: Graphics Engine Exception", "pci:0000:17:00"),
    Case("xid119-gsp",
         "Dec 01 10:00:00 n1 kernel: NVRM: Xid (PCI:0000:ad:00): 119, pid=991, name=python, Timeout after 6s of "
         "waiting for RPC response from GPU0 GSP! Expected function 76 (GSP_RM_CONTROL).",
         "gpu_xid", ": 119,", "Xid 119: GSP RPC Timeout"),
    Case("xid-code-not-in-table", "NVRM: Xid (PCI:0000:01:00): 150, pid=1, name=python, something new", "gpu_xid",
         ": 150,", "Xid 150: a code outside the built-in table"),
    # -- gpu_ecc --
    Case("root-inside-watchdog-line",
         log(NOISE, "[rank0]:[E1201 10:00:00.000000 ProcessGroupNCCL.cpp:1595] [PG ID 0 PG GUID 0(default_pg) Rank 0] "
                    "Process group watchdog thread terminated with exception: CUDA error: uncorrectable ECC error "
                    "encountered", WATCHDOG),
         "gpu_ecc", "uncorrectable ECC error encountered", "uncorrectable ECC error", "rank:0", 7),
    Case("amdgpu-ras-umc",
         log("[ 3011.100000] amdgpu 0000:c1:00.0: amdgpu: 1 uncorrectable hardware errors detected in umc block",
             "[ 3011.100100] amdgpu 0000:c1:00.0: amdgpu: GPU reset begin!"),
         "gpu_ecc", "uncorrectable hardware errors detected in umc block", "in the umc block", "pci:0000:c1:00"),
    Case("hip-ecc", "[rank5]: RuntimeError: HIP error: hipErrorECCNotCorrectable", "gpu_ecc",
         "hipErrorECCNotCorrectable", "uncorrectable ECC", "rank:5"),
    Case("nvlink-uncorrectable", "RuntimeError: CUDA error: uncorrectable NVLink error was detected during the "
         "execution", "gpu_ecc", "NVLink", "NVLink"),
    Case("edac-ue-not-ce",
         log("[ 100.0] EDAC MC0: 1 CE memory read error on CPU_SrcID#0_MC#0_Chan#1_DIMM#0 (channel:1 slot:0 "
             "page:0x1234 offset:0x0 grain:32)",
             "[ 200.0] EDAC MC1: 1 UE memory read error on CPU_SrcID#1_MC#0_Chan#0_DIMM#0 (channel:0 slot:0 "
             "page:0x5678 offset:0x0 grain:32)"),
         "gpu_ecc", "1 UE memory read error", "EDAC"),
    Case("mce-uncorrected", "[ 9.1] mce: [Hardware Error]: Machine check: Uncorrected error in bank 17", "gpu_ecc",
         "Machine check", "uncorrected hardware error"),
    # -- gpu_hang --
    Case("amdgpu-ring-timeout",
         log(NOISE,
             "[ 1234.567890] amdgpu 0000:c1:00.0: [drm:amdgpu_job_timedout [amdgpu]] *ERROR* ring gfx_0.0.0 timeout, "
             "signaled seq=12345, emitted seq=12347",
             "[ 1234.567900] amdgpu 0000:c1:00.0: [drm:amdgpu_job_timedout [amdgpu]] *ERROR* Process information: "
             "process python pid 4321 thread python pid 4321",
             "[ 1234.568000] amdgpu 0000:c1:00.0: amdgpu: GPU reset begin!",
             "[ 1236.000000] amdgpu 0000:c1:00.0: amdgpu: GPU reset(2) succeeded!",
             WATCHDOG),
         "gpu_hang", "ring gfx_0.0.0 timeout", "ring gfx_0.0.0 timeout", "pci:0000:c1:00", 7),
    Case("amdgpu-sdma-timeout", "[ 77.1] amdgpu 0000:83:00.0: [drm:amdgpu_job_timedout [amdgpu]] *ERROR* ring sdma0 "
         "timeout, signaled seq=77, emitted seq=79", "gpu_hang", "ring sdma0 timeout", "sdma0"),
    Case("amdgpu-mes",
         log("[ 500.1] amdgpu 0000:c1:00.0: amdgpu: MES failed to response msg=3",
             "[ 500.2] amdgpu 0000:c1:00.0: amdgpu: failed to remove hardware queue from MES, doorbell=0x1202"),
         "gpu_hang", "MES failed to response", "MES"),
    Case("rocr-gpu-hang",
         log(NOISE, "HW Exception by GPU node-1 (Agent handle: 0x55d0c0f0a0b0) reason :GPU Hang",
             "Fatal Python error: Aborted", TORCHRUN_SUMMARY),
         "gpu_hang", "reason :GPU Hang", "GPU hang", cascade=5),
    Case("rocr-hw-exception",
         ":0:rocdevice.cpp            :2881: 123456789 us: [pid:4321  tid:0x7f12345] Callback: Queue 0x7f1234000000 "
         "aborting with error : HSA_STATUS_ERROR_EXCEPTION: An HSAIL operation resulted in a hardware exception. "
         "code: 0x1016",
         "gpu_hang", "HSA_STATUS_ERROR_EXCEPTION", "code 0x1016"),
    Case("cuda-launch-timeout", "[rank0]: RuntimeError: CUDA error: the launch timed out and was terminated",
         "gpu_hang", "launch timed out", "timed out"),
    # -- pcie --
    Case("aer-fatal",
         log("[ 5012.345678] pcieport 0000:00:01.0: AER: Uncorrected (Fatal) error received: 0000:3b:00.0",
             "[ 5012.345690] nvidia 0000:3b:00.0: PCIe Bus Error: severity=Uncorrected (Fatal), type=Inaccessible, "
             "(Unregistered Agent ID)",
             "[ 5012.400000] NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=python, GPU has fallen off the bus.",
             WATCHDOG),
         "pcie", "AER: Uncorrected (Fatal) error received", "Uncorrected (Fatal)", "pci:0000:3b:00.0", 7),
    Case("aer-corrected",
         log("[ 88.1] pcieport 0000:00:03.1: AER: Corrected error received: 0000:00:03.1",
             "[ 88.2] pcieport 0000:00:03.1: PCIe Bus Error: severity=Corrected, type=Physical Layer, (Receiver ID)"),
         "pcie", "AER: Corrected error received", "Corrected", "pci:0000:00:03.1"),
    Case("aer-new-kernel-format",
         "pcieport 0000:00:01.0: AER: Multiple Uncorrectable (Non-Fatal) error message received from 0000:01:00.0",
         "pcie", "Multiple Uncorrectable", "multiple Uncorrectable (Non-Fatal)", "pci:0000:01:00.0"),
    Case("pcie-bus-error-alone",
         "nvidia 0000:3b:00.0: PCIe Bus Error: severity=Uncorrected (Non-Fatal), type=Transaction Layer, "
         "(Requester ID)",
         "pcie", "PCIe Bus Error", "type=Transaction Layer", "pci:0000:3b:00.0"),
    # -- nic --
    Case("ib-completion-status-12",
         log(NOISE,
             "node3:1234:1290 [5] transport/net_ib.cc:1696 NCCL WARN NET/IB : Got completion from peer "
             "10.0.0.2<45678> with status=12 opcode=0 len=0 vendor err 129 (Send) localGid ::ffff:10.0.0.3 "
             "remoteGids::ffff:10.0.0.2 hca mlx5_0",
             "node3:1234:1290 [5] NCCL INFO transport/net.cc:1298 -> 6",
             WATCHDOG),
         "nic", "with status=12", "status 12 (transport retry counter exceeded)", "ib:mlx5_0", 7),
    Case("ib-completion-old-format",
         "node1:99:120 [0] NCCL WARN NET/IB : Got completion from peer 10.1.1.2<35421> with error 12, opcode 0, len 0, "
         "vendor err 129 (Recv)",
         "nic", "with error 12", "retry counter exceeded"),
    Case("ib-async-port-error", "node1:99:130 [0] NCCL WARN NET/IB : mlx5_1:1 Got async event : port error", "nic",
         "port error", "IB async event: port error", "ib:mlx5_1/1"),
    Case("mlx5-link-down", log(NOISE, "[ 9000.100000] mlx5_core 0000:5e:00.0 ens1f0np0: Link down", WATCHDOG),
         "nic", "Link down", "link down on ens1f0np0", "nic:ens1f0np0", 7),
    Case("bnxt-link-down", "Dec 01 10:00:00 node2 kernel: bnxt_en 0000:3b:00.0 eth0: NIC Link is Down", "nic",
         "NIC Link is Down", "eth0", "nic:eth0"),
    Case("rdma-link-state-down",
         log("link mlx5_0/1 state ACTIVE physical_state LINK_UP netdev ens1f0np0",
             "link mlx5_1/1 state DOWN physical_state DISABLED netdev ens1f1np1"),
         "nic", "mlx5_1/1 state DOWN", "mlx5_1/1", "ib:mlx5_1/1"),
    Case("ibstat-state-down",
         log("CA 'mlx5_2'", "\tCA type: MT4129", "\tNumber of ports: 1", "\tFirmware version: 28.39.1002", "\tPort 1:",
             "\t\tState: Down", "\t\tPhysical state: Disabled", "\t\tRate: 10"),
         "nic", "State: Down", "ibstat", "ib:mlx5_2/1"),
    # -- oom --
    Case("oom-one-rank-childfailed-others", log(NOISE, OOM_TRACEBACK, WATCHDOG, TORCHRUN_SUMMARY),
         "oom", "torch.OutOfMemoryError: CUDA out of memory", "tried to allocate 2.00 GiB", "gpu:1", 10),
    Case("oom-inside-distbackenderror",
         log("terminate called after throwing an instance of 'c10::DistBackendError'",
             "  what():  [PG ID 0 PG GUID 0(default_pg) Rank 2] Process group watchdog thread terminated with "
             "exception: CUDA error: out of memory"),
         "oom", "CUDA error: out of memory", "out of memory", "rank:2", 1),
    Case("oom-kernel-killer",
         log(NOISE,
             "Dec 01 10:04:59 node0 kernel: python invoked oom-killer: gfp_mask=0x140cca(GFP_HIGHUSER_MOVABLE|"
             "__GFP_COMP), order=0, oom_score_adj=0",
             "Dec 01 10:05:00 node0 kernel: Out of memory: Killed process 4302 (python) total-vm:812345678kB, "
             "anon-rss:523456789kB, file-rss:0kB, shmem-rss:0kB, UID:1000 pgtables:1234567kB oom_score_adj:0",
             TORCHRUN_SUMMARY),
         "oom", "invoked oom-killer", "OOM killer", cascade=5),
    Case("oom-cgroup", "[ 77.7] Memory cgroup out of memory: Killed process 991 (pt_main_thread) total-vm:1kB", "oom",
         "Memory cgroup out of memory", "killed process 991 (pt_main_thread)"),
    Case("oom-nccl-cuda-failure", "node0:1:2 [0] include/alloc.h:125 NCCL WARN Cuda failure 2 'out of memory'", "oom",
         "Cuda failure 2 'out of memory'", "device out of memory"),
    Case("oom-hip",
         "[rank0]: torch.OutOfMemoryError: HIP out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity "
         "of 191.98 GiB of which 1.00 GiB is free.",
         "oom", "HIP out of memory", "1.50 GiB", "gpu:0"),
    Case("oom-cpu-allocator",
         log(text("""
             Traceback (most recent call last):
               File "/workspace/load.py", line 10, in <module>
                 x = torch.empty(1 << 40)
             """),
             "RuntimeError: [enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: you "
             "tried to allocate 4398046511104 bytes."),
         "oom", "DefaultCPUAllocator", "host out of memory"),
    # -- nan --
    Case("nan-trainer-line", log(NOISE, "step 12: the loss is nan; stopping (last checkpoint kept)"), "nan",
         "the loss is nan", "non-finite loss (nan)"),
    Case("nan-zaya-error-line", "[rank1]: zaya: error (rank 1): step 12: the loss is nan; stopping", "nan",
         "the loss is nan", "nan", "rank:1"),
    Case("nan-grad-norm-inf", "iteration 300/1000 | grad norm is inf | skipping", "nan", "grad norm is inf", "inf"),
    Case("nan-anomaly-mode",
         text("""
             Traceback (most recent call last):
               File "/workspace/train.py", line 40, in step
                 loss.backward()
             RuntimeError: Function 'LogSoftmaxBackward0' returned nan values in its 0th output.
             """),
         "nan", "returned nan values", "LogSoftmaxBackward0"),
    Case("nan-loss-scale-floor",
         log("[2024-12-01 10:00:00,000] [INFO] [loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! Rank 0 "
             "Skipping step. Attempted loss scale: 2, reducing to 1",
             "[2024-12-01 10:00:01,000] [INFO] [loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! Rank 0 "
             "Skipping step. Attempted loss scale: 1, reducing to 1",
             "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run."),
         "nan", "reducing to 1", "floor"),
    Case("nanosecond-noise-is-not-nan",
         text("""
             timer resolution: 1 nanoseconds; NCCL_NANOSLEEP unset
             building a nanoGPT-style model; maintenance window ends 10:00
             Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0
             step 5 | loss 3.21 | grad_norm 0.9
             """),
         "unknown", detail="no known failure signature"),
    # -- storage --
    Case("enospc-on-checkpoint",
         log(NOISE,
             "[rank0]: Traceback (most recent call last):",
             '[rank0]:   File "/workspace/zaya/train/checkpoint.py", line 120, in save',
             "[rank0]:     torch.save(state, tmp)",
             "[rank0]: OSError: [Errno 28] No space left on device: '/ckpt/run1/step_000400/model.pt'",
             WATCHDOG),
         "storage", "[Errno 28] No space left on device", "No space left on device (errno 28)",
         "path:/ckpt/run1/step_000400/model.pt", 7),
    Case("eio", "OSError: [Errno 5] Input/output error", "storage", "Input/output error", "errno 5"),
    Case("stale-nfs", "OSError: [Errno 116] Stale file handle: '/shared/data/shard_0001.bin'", "storage",
         "Stale file handle", "Stale file handle", "path:/shared/data/shard_0001.bin"),
    Case("kernel-io-error",
         "[ 64.2] blk_update_request: I/O error, dev nvme0n1, sector 123456 op 0x1:(WRITE) flags 0x800 phys_seg 1",
         "storage", "I/O error, dev nvme0n1", "nvme0n1"),
    Case("nfs-not-responding", "Dec 01 10:00:00 node0 kernel: nfs: server fs01 not responding, still trying",
         "storage", "fs01", "NFS server fs01"),
    # -- python --
    Case("python-traceback-evidence-is-the-exception",
         log(NOISE,
             "[default1]:Traceback (most recent call last):",
             '[default1]:  File "/workspace/train.py", line 12, in <module>',
             "[default1]:    main()",
             '[default1]:  File "/workspace/train.py", line 9, in main',
             '[default1]:    batch = next(it)["input_ids"]',
             "[default1]:KeyError: 'input_ids'",
             WATCHDOG, TORCHRUN_SUMMARY),
         "python", "KeyError: 'input_ids'", "uncaught KeyError", "rank:1", 10),
    Case("python-chained-first-exception-wins",
         text("""
             Traceback (most recent call last):
               File "/workspace/data.py", line 3, in load
                 return table[key]
             KeyError: 'shard_7'

             During handling of the above exception, another exception occurred:

             Traceback (most recent call last):
               File "/workspace/train.py", line 30, in <module>
                 load("shard_7")
             RuntimeError: could not load shard_7
             """),
         "python", "KeyError: 'shard_7'", "KeyError"),
    Case("python-shape-mismatch",
         text("""
             [rank0]: Traceback (most recent call last):
             [rank0]:   File "/workspace/model.py", line 77, in forward
             [rank0]:     return self.proj(x)
             [rank0]: RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x8 and 16x32)
             """),
         "python", "mat1 and mat2", "uncaught RuntimeError", "rank:0"),
    Case("python-bare-assertion",
         text("""
             Traceback (most recent call last):
               File "/workspace/check.py", line 2, in <module>
                 assert x > 0
             AssertionError
             """),
         "python", "AssertionError", "uncaught AssertionError"),
    Case("zaya-cli-error", "zaya: error: config.yaml: train.lr: expected a number, got 'fast'", "python",
         "zaya: error: config.yaml", "zaya stopped with an error"),
    Case("nccl-runtime-error-is-cascade",
         log("[rank1]: Traceback (most recent call last):",
             '[rank1]:   File "/workspace/train.py", line 50, in step',
             "[rank1]:     dist.all_reduce(t)",
             "[rank1]: torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/"
             "ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error, NCCL version 2.20.5",
             "[rank1]: ncclRemoteError: A call failed possibly due to a network error or a remote process exiting "
             "prematurely.",
             "[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
             "[10.0.0.2]:26530",
             "[W1201 10:00:00.000000 socket.cpp:697] [c10d] The client socket has failed to connect to [node0]:29500 "
             "(errno: 111 - Connection refused).",
             "torch.distributed.DistNetworkError: Failed to recv, got 0 bytes. Connection was likely closed. Did the "
             "remote server shutdown or crash?"),
         "unknown", detail="only consequences", cascade=5),
    # -- unknown --
    Case("watchdogs-alone", log(NOISE, WATCHDOG, TORCHRUN_SUMMARY), "unknown", detail="only consequences",
         cascade=12),
    Case("ib-flush-alone-is-cascade",
         "n:1:2 [0] NCCL WARN NET/IB : Got completion from peer 10.0.0.2<1> with status=5 opcode=0 len=0 vendor err "
         "249 (Recv) localGid ::ffff:10.0.0.3 remoteGids::ffff:10.0.0.2 hca mlx5_0",
         "unknown", detail="only consequences", cascade=1),
    Case("benign-ib-event", "n:1:2 [0] NCCL WARN NET/IB : Got async event : GID table change", "unknown"),
    Case("noise-only", NOISE, "unknown", detail="no known failure signature"),
    Case("empty", "", "unknown", detail="no known failure signature"),
]



# One real-format line per signature: every rule is exercised, and each names the class it should.
RULE_SAMPLES = [
    ("gpu_xid", "NVRM: Xid (PCI:0000:3b:00): 74, pid=7, name=python, NVLink: fatal error detected on link 3"),
    ("gpu_xid", "[ 269.516977] NVRM: GPU at PCI:0000:01:00: GPU has fallen off the bus."),
    ("gpu_ecc", "RuntimeError: CUDA error: uncorrectable ECC error encountered"),
    ("gpu_ecc", "torch.AcceleratorError: HIP error: hipErrorECCNotCorrectable"),
    ("gpu_ecc", "NCCL WARN Cuda failure 'uncorrectable NVLink error was detected during the execution'"),
    ("gpu_ecc", "amdgpu 0000:c1:00.0: amdgpu: 2 uncorrectable hardware errors detected in gfx block"),
    ("gpu_ecc", "amdgpu 0000:c1:00.0: amdgpu: RAS: uncorrectable error in XGMI/WAFL"),
    ("gpu_ecc", "amdgpu 0000:c1:00.0: amdgpu: Poison consumption detected on GPU"),
    ("gpu_ecc", "{1}[Hardware Error]: event severity: fatal"),
    ("gpu_ecc", "mce: Uncorrected hardware memory error in user-access at 2a5e1c000"),
    ("gpu_ecc", "EDAC MC0: 1 UE memory read error on CPU_SrcID#0_MC#0_Chan#0_DIMM#1"),
    ("gpu_hang", "amdgpu 0000:83:00.0: [drm:amdgpu_job_timedout [amdgpu]] *ERROR* ring comp_1.0.0 timeout"),
    ("gpu_hang", "amdgpu 0000:83:00.0: [drm:amdgpu_job_timedout [amdgpu]] *ERROR* Process information: process"),
    ("gpu_hang", "amdgpu 0000:83:00.0: amdgpu: failed to remove hardware queue from MES, doorbell=0x1202"),
    ("gpu_hang", "amdgpu 0000:83:00.0: amdgpu: GPU recovery disabled."),
    ("gpu_hang", "HW Exception by GPU node-2 (Agent handle: 0x5566) reason :GPU Hang"),
    ("gpu_hang", "Callback: Queue 0x7f00 aborting with error : HSA_STATUS_ERROR_EXCEPTION: An HSAIL operation"),
    ("gpu_hang", "Callback: Queue 0x7f00 aborting with error : HSA_STATUS_ERROR_MEMORY_APERTURE_VIOLATION: The "
                 "agent attempted to access memory beyond the largest legal address. code: 0x29"),
    ("gpu_hang", "hipErrorLaunchTimeOut"),
    ("pcie", "pcieport 0000:00:01.0: AER: Uncorrected (Non-Fatal) error received: 0000:01:00.0"),
    ("pcie", "mlx5_core 0000:5e:00.0: PCIe Bus Error: severity=Corrected, type=Data Link Layer, (Transmitter ID)"),
    ("pcie", "pcieport 0000:00:03.0: DPC: containment event, status:0x1f01 source:0x0000"),
    ("pcie", "pcieport 0000:00:1c.0: pciehp: Slot(8): Link Down"),
    ("nic", "NCCL WARN NET/IB : Got completion from peer 10.0.0.9<5> with status=13 opcode=1 len=0 vendor err 136"),
    ("nic", "NCCL WARN NET/IB : mlx5_3:1 async fatal event: local catastrophic error"),
    ("nic", "ibv_poll_cq: transport retry counter exceeded"),
    ("nic", "NCCL WARN Call to ibv_modify_qp failed with error Connection timed out errno 110"),
    ("nic", "mlx5_core 0000:5e:00.0: mlx5_port_module_event:1131:(pid 0): Port module event[error]: module 0, "
            "Cable error, High Temperature"),
    ("nic", "ixgbe 0000:01:00.0 eth2: NIC Link is Down"),
    ("nic", "bond0: link status definitely down for interface eth1, disabling it"),
    ("nic", "link rocep94s0f0/1 state DOWN physical_state POLLING netdev ens1f0"),
    ("nic", "\t\tState: Down"),
    ("nic", "\t\t\tstate:\t\t\tPORT_DOWN (1)"),
    ("oom", "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 3; 79.15 GiB total "
            "capacity; 77.50 GiB already allocated)"),
    ("oom", "RuntimeError: hipErrorOutOfMemory"),
    ("oom", "RuntimeError: [enforce fail at alloc_cpu.cpp:83] err == 0. DefaultCPUAllocator: can't allocate memory: "
            "you tried to allocate 1073741824 bytes. Error code 12 (Cannot allocate memory)"),
    ("oom", "Out of memory: Kill process 2345 (python3) score 912 or sacrifice child"),
    ("oom", "oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=job1,mems_allowed=0-1,oom_memcg=/slurm/job1,"
            "task_memcg=/slurm/job1,task=python,pid=4302,uid=1000"),
    ("oom", "MemoryError"),
    ("oom", "terminate called after throwing an instance of 'std::bad_alloc'"),
    ("nan", "step 40 | loss = NaN | lr 3e-4"),
    ("nan", '{"step": 40, "loss": NaN, "lr": 0.0003}'),
    ("nan", "step 41: non-finite loss (inf)"),
    ("nan", "grad_norm: nan"),
    ("nan", "Rank 0: found NaN in local grad norm in backward pass before data-parallel communication collective"),
    ("nan", "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run."),
    ("nan", "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 1e-05"),
    ("nan", "FloatingPointError: Minimum loss scale reached (0.0001). Your loss is probably exploding."),
    ("nan", "RuntimeError: Function 'MulBackward0' returned nan values in its 1st output."),
    ("storage", "OSError: [Errno 122] Disk quota exceeded: '/home/u/ckpt/step_9'"),
    ("storage", "cp: error writing '/ckpt/x': Read-only file system"),
    ("storage", "write failed: ENOSPC"),
    ("storage", "Buffer I/O error on dev sdb1, logical block 0, lost async page write"),
    ("storage", "EXT4-fs error (device sda1): ext4_find_entry:1455: inode #2: comm python: reading directory lblock 0"),
    ("storage", "XFS (md0): metadata I/O error in \"xfs_trans_read_buf_map\" at daddr 0x2 len 1 error 5"),
    ("storage", "nfs: server storage01.cluster not responding, timed out"),
    ("storage", "LustreError: 167-0: lustre-OST0002-osc: This client was evicted by lustre-OST0002"),
    ("storage", "BTRFS error (device nvme1n1): bdev /dev/nvme1n1 errs: wr 1, rd 0, flush 0, corrupt 0, gen 0"),
    ("storage", "nvme nvme0: I/O 258 (I/O Cmd) QID 4 timeout, aborting"),
    ("cascade", "[E1201 10:00:00.000 ProcessGroupNCCL.cpp:1300] ProcessGroupNCCL's watchdog got stuck for 480 seconds"),
    ("cascade", "RuntimeError: NCCL communicator was aborted on rank 3."),
    ("cascade", "[Rank 0] Some NCCL operations have failed or timed out."),
    ("cascade", "[rank0]: zaya.owned.Terminated: 143"),
    ("cascade", "[Rank 0] To avoid data inconsistency, we are taking the entire process down."),
    ("cascade", "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting"),
    ("cascade", "[Rank 1] Heartbeat monitor timed out! Process will be terminated after dumping debug info."),
    ("cascade", "[Rank 1] Timeout at NCCL work: 812, last enqueued NCCL work: 812, last completed NCCL work: 811."),
    ("cascade", "[Rank 1] ProcessGroupNCCL preparing to dump debug info. Include a stack trace: 1"),
    ("cascade", "NCCL WARN [Proxy Service 3] Failed to execute operation Close from rank 3, retcode 3"),
    ("cascade", "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:"),
    ("cascade", "  exitcode  : -9 (pid: 7788)"),
    ("cascade", "  traceback : Signal 9 (SIGKILL) received by PID 7788"),
    ("cascade", "NCCL WARN socketProgress: Connection reset by remote peer"),
    ("cascade", "BrokenPipeError: [Errno 32] Broken pipe"),
    ("cascade", "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Read error [10.0.0.2]:46532: Connection reset"),
    ("cascade", "Timed out waiting 1800000ms for send operation to complete"),
    ("cascade", "c10::DistStoreError: Socket Timeout"),
    ("cascade", "Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server shutdown or crash?"),
    ("cascade", "[c10d] TCPStore client failed to connect"),
    ("cascade", "[c10d] The server socket has failed to listen on any local network address."),
    ("cascade", "torch.distributed.elastic.rendezvous.api.RendezvousClosedError"),
]


@pytest.mark.parametrize("expected, line", RULE_SAMPLES, ids=[f"{i}-{c}" for i, (c, _) in enumerate(RULE_SAMPLES)])
def test_each_signature(expected, line):
    diagnosis = classify_lines([line])
    if expected == "cascade":
        assert (diagnosis.root, diagnosis.cascade) == ("unknown", [line]), diagnosis
    else:
        assert (diagnosis.root, diagnosis.line) == (expected, line), diagnosis
        assert diagnosis.detail and "?" not in diagnosis.detail


def test_every_rule_has_a_sample():
    """The rules of a run's course have theirs in test_diagnose_course.py."""
    matched = set()
    for _, line in RULE_SAMPLES:
        rule, _ = _Classifier._match(_triggered(line.lower()), line)
        matched.add(_RULES.index(rule))
    assert [rule.regex.pattern for i, rule in enumerate(_RULES) if i not in matched and rule.root not in COURSE] == []


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_root_cause(case):
    diagnosis = classify_text(case.log)
    assert diagnosis.root == case.root, diagnosis
    assert diagnosis.root in ROOT_CLASSES
    if case.root == "unknown":
        assert diagnosis.line == ""
    else:
        assert case.line in diagnosis.line, diagnosis
        assert diagnosis.line in case.log.splitlines(), "the evidence is a verbatim input line"
    assert case.detail in diagnosis.detail, diagnosis
    if case.subject is not None:
        assert diagnosis.subject == case.subject, diagnosis
    assert len(diagnosis.cascade) >= min(case.cascade, 20), diagnosis
    assert all(line in case.log.splitlines() for line in diagnosis.cascade)
    assert diagnosis.line not in diagnosis.cascade


def test_watchdog_lines_alone_are_listed_as_the_cascade_in_order():
    diagnosis = classify_text(WATCHDOG)
    assert (diagnosis.root, diagnosis.line) == ("unknown", "")
    assert diagnosis.cascade == WATCHDOG.splitlines()
    assert diagnosis.cascade_total == len(WATCHDOG.splitlines())


def test_a_worker_the_agent_terminated_is_a_cascade_not_a_python_error():
    """torchrun's SIGTERM to the surviving ranks unwinds them with zaya's `Terminated` (exit 143): when its
    traceback reaches the log, the root is still the rank that died first, not an uncaught exception."""
    log = "\n".join([
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "/x/zaya/cli.py", line 10, in main',
        "[rank0]: zaya.owned.Terminated: 143",
        "W1205 12:44:01 torch/distributed/elastic/multiprocessing/api.py:900] Sending process 4411 closing signal "
        "SIGTERM",
    ])
    diagnosis = classify_text(log)
    assert diagnosis.root == "unknown" and "[rank0]: zaya.owned.Terminated: 143" in diagnosis.cascade


def test_cascade_is_capped_but_counted():
    diagnosis = classify_lines([WATCHDOG.splitlines()[0]] * 50 + [XID_79])
    assert diagnosis.root == "gpu_xid"
    assert len(diagnosis.cascade) == 20 and diagnosis.cascade_total == 50
    assert diagnosis.to_dict()["cascade_total"] == 50


def test_earliest_root_wins_in_input_order():
    storage = "OSError: [Errno 28] No space left on device: '/ckpt/a'"
    oom = "Dec 01 10:05:00 node0 kernel: Out of memory: Killed process 4302 (python)"
    assert classify_lines([storage, oom]).root == "storage"
    assert classify_lines([oom, storage]).root == "oom"


def test_timestamps_order_lines_across_files(tmp_path):
    # The worker's kernel log is given first, but the other node's Xid happened five minutes earlier.
    worker = tmp_path / "node0-dmesg.txt"
    worker.write_text("Dec 01 10:05:00 node0 kernel: Out of memory: Killed process 4302 (python)\n")
    other = tmp_path / "node1-dmesg.txt"
    other.write_text(f"Dec 01 10:00:00 node1 kernel: {XID_79.split('kernel: ', 1)[1]}\n")
    diagnosis = classify_files([worker, other])
    assert diagnosis.root == "gpu_xid"
    assert diagnosis.source == f"{other}:1"
    # ISO stamps with offsets are compared in UTC: 10:00+02:00 is before 09:30Z.
    first = tmp_path / "a.log"
    first.write_text("2024-12-01T09:30:00.000000Z node0 kernel: nfs: server fs01 not responding, still trying\n")
    second = tmp_path / "b.log"
    second.write_text("2024-12-01T10:00:00.000000+02:00 node1 kernel: mlx5_core 0000:5e:00.0 ib0: Link down\n")
    assert classify_files([first, second]).root == "nic"


def test_without_comparable_timestamps_input_order_decides(tmp_path):
    worker = tmp_path / "rank0.log"
    worker.write_text(OOM_TRACEBACK + "\n")
    kernel = tmp_path / "dmesg.txt"
    kernel.write_text("Dec 01 09:00:00 node1 kernel: [ 10.0] pcieport 0000:00:01.0: AER: Corrected error received: "
                      "0000:00:01.0\n")
    assert classify_files([worker, kernel]).root == "oom"
    assert classify_files([kernel, worker]).root == "pcie"


def test_source_names_the_file_and_line(tmp_path):
    log = tmp_path / "node.log"
    log.write_text("\n".join([NOISE, XID_79, WATCHDOG]) + "\n")
    diagnosis = classify_files([log])
    lineno = len(NOISE.splitlines()) + 1
    assert diagnosis.source == f"{log}:{lineno}"
    assert diagnosis.one_line() == f"gpu_xid: Xid 79: GPU has fallen off the bus at {log}:{lineno}: {XID_79}"
    assert classify_lines([XID_79], source="dmesg").source == "dmesg:1"
    assert classify_text(XID_79).source == ""


def test_torchrun_prefix_is_stripped_for_matching_but_kept_in_the_evidence():
    line = "[rank7]:[W1201 10:00:00.123456 ProcessGroupNCCL.cpp:1234] step 3: non-finite loss (nan)"
    diagnosis = classify_lines([line + "\n"])
    assert (diagnosis.root, diagnosis.line, diagnosis.subject) == ("nan", line, "rank:7")


def test_tracebacks_of_interleaved_ranks_are_kept_apart():
    lines = [
        "[rank0]: Traceback (most recent call last):",
        "[rank1]: Traceback (most recent call last):",
        '[rank0]:   File "a.py", line 1, in <module>',
        '[rank1]:   File "b.py", line 1, in <module>',
        "[rank1]: ValueError: bad batch",
        "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity",
    ]
    diagnosis = classify_lines(lines)
    assert (diagnosis.root, diagnosis.line, diagnosis.subject) == ("python", lines[4], "rank:1")


def test_a_traceback_whose_header_was_cut_off_still_ends_in_its_exception():
    tail = [  # the supervisor reads a log's tail, which can start inside a traceback
        '[rank2]:   File "/workspace/train.py", line 9, in main',
        '[rank2]:     batch = next(it)["input_ids"]',
        "[rank2]: KeyError: 'input_ids'",
    ]
    diagnosis = classify_lines([*tail, *WATCHDOG.splitlines()])
    assert (diagnosis.root, diagnosis.line, diagnosis.subject) == ("python", tail[2], "rank:2")


def test_a_flood_of_secondary_xids_does_not_hide_the_real_one():
    flood = ["NVRM: Xid (PCI:0000:5e:00): 45, pid=1234, name=python, Ch 00000008"] * 200
    real = "NVRM: Xid (PCI:0000:5e:00): 95, pid=1234, name=python, Uncontained: LTC TAG (0x2,0x0). RST: Yes"
    assert classify_lines([*flood, real]).line == real


def test_an_exception_name_outside_a_traceback_is_not_python():
    assert classify_text("ValueError: printed by a logger, not raised").root == "unknown"


def test_code_inside_a_traceback_is_not_evidence():
    log = text("""
        Traceback (most recent call last):
          File "/workspace/guard.py", line 5, in check
            raise RuntimeError("loss is nan")  # the source line quoted by the traceback
        RuntimeError: step 9 diverged
        """)
    diagnosis = classify_text(log)
    assert (diagnosis.root, diagnosis.line) == ("python", "RuntimeError: step 9 diverged")


def test_every_xid_in_the_brief_has_its_catalog_meaning():
    expected = {13: "Graphics Engine Exception", 31: "GPU memory page fault", 43: "GPU stopped processing",
                45: "Preemptive cleanup, due to previous errors", 48: "Double Bit ECC Error",
                63: "ECC page retirement or row remapping recording event",
                64: "ECC page retirement or row remapper recording failure", 74: "NVLINK Error",
                79: "GPU has fallen off the bus", 94: "Contained ECC error", 95: "Uncontained ECC error",
                119: "GSP RPC Timeout", 120: "GSP Error"}
    for code, meaning in expected.items():
        assert XID_MEANINGS[code] == meaning
    for code in (8, 32, 38, 61, 62, 68, 69, 73, 92, 109, 121, 140, 143):
        assert XID_MEANINGS[code]
    line = "NVRM: Xid (PCI:0000:3b:00): 95, pid=7, name=python, Uncontained: LTC TAG (0x2,0x0). RST: Yes, D-RST: No"
    assert classify_text(line).detail == "Xid 95: Uncontained ECC error"


def test_rule_keywords_are_words_the_scan_can_find():
    for rule in _RULES:
        for keyword in rule.keywords:
            assert keyword and keyword.translate(_SEPARATORS) == keyword and keyword == keyword.lower(), rule


def test_diagnosis_views():
    diagnosis = classify_text("\n".join([XID_79, WATCHDOG]))
    as_dict = diagnosis.to_dict()
    assert {"root", "line", "detail", "cascade", "source", "subject"} <= set(as_dict)
    assert json.loads(json.dumps(as_dict)) == as_dict
    assert diagnosis.finding() == Finding(signal="gpu_xid", subject="pci:0000:3b:00", line=XID_79,
                                          detail="Xid 79: GPU has fallen off the bus")
    unknown = Diagnosis("unknown", "", "no known failure signature in the logs", [])
    assert unknown.one_line() == "unknown: no known failure signature in the logs"
    assert unknown.finding().signal == "unknown"


def test_odd_content_never_raises():
    junk = ["\x00\x01\x02\xff" * 50, "\ud800" * 3, "[" * 10000, "x" * 1_000_000, "[rank99999999999]:",
            "Dec 99 99:99:99", "2024-13-45T99:99:99+99:99 NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",
            "\t" * 100, "\r"]
    diagnosis = classify_lines(junk)
    assert diagnosis.root == "gpu_xid"
    assert classify_lines([b"\xff\xfe NVRM: Xid (PCI:0000:3b:00): 13, junk"]).root == "gpu_xid"
    progress = classify_text("step 1/9 [00:01]\rstep 2/9 [00:02]\r\n" + XID_79 + "\r\n")  # tqdm's carriage returns
    assert (progress.root, progress.line) == ("gpu_xid", XID_79)


def test_binary_junk_in_a_file_is_tolerated(tmp_path):
    log = tmp_path / "mixed.log"
    log.write_bytes(b"\x00\xff\xfe garbage \x80\x81\n" + XID_79.encode() + b"\n\xc3\x28 more garbage\n")
    assert classify_files([log]).root == "gpu_xid"


def test_unreadable_files_are_a_zaya_error(tmp_path):
    with pytest.raises(ZayaError, match=re.escape(f"{tmp_path / 'missing.log'}: file not found")):
        classify_files([tmp_path / "missing.log"])
    with pytest.raises(ZayaError, match=re.escape(f"{tmp_path}: a directory, not a regular file; a log must be")):
        classify_files([tmp_path])


def test_a_hundred_thousand_lines_take_well_under_two_seconds():
    lines = []
    for i in range(100_000):
        kind = i % 4
        if kind == 0:
            lines.append(f"[rank{i % 8}]: step {i} | loss 3.{i % 1000:03d} | lr 3e-4 | grad_norm 0.{i % 97} | tok/s 1")
        elif kind == 1:
            lines.append(f"node{i % 4}:4321:4399 [{i % 8}] NCCL INFO Channel {i % 32:02d}/0 : 0[0] -> 1[1] via P2P/IPC")
        elif kind == 2:
            lines.append(f"[{i / 10:12.6f}] usb 1-{i % 4}: new high-speed USB device number {i % 100} using xhci_hcd")
        else:
            lines.append(f"2024-12-01 10:{i % 60:02d}:00,123 INFO data: shard {i} loaded in {i % 999} nanoseconds")
    lines[99_000] = XID_79
    started = time.perf_counter()
    diagnosis = classify_lines(lines)
    elapsed = time.perf_counter() - started
    assert diagnosis.root == "gpu_xid"
    assert elapsed < 2.0, f"{elapsed:.2f} s"


# ---- the command ---------------------------------------------------------------------------------------


@pytest.fixture
def incident(tmp_path):
    worker = tmp_path / "worker.log"
    worker.write_text("\n".join([NOISE, WATCHDOG]) + "\n")
    kernel = tmp_path / "dmesg.txt"
    kernel.write_text(XID_79 + "\n")
    return worker, kernel


def test_cli_json(incident):
    worker, kernel = incident
    result = CliRunner().invoke(diagnose, [str(worker), str(kernel), "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert payload["root"] == "gpu_xid"
    assert payload["line"] == XID_79
    assert payload["detail"] == "Xid 79: GPU has fallen off the bus"
    assert payload["cascade"] == WATCHDOG.splitlines()
    assert payload["source"] == f"{kernel}:1" and payload["subject"] == "pci:0000:3b:00"


def test_cli_one_line(incident):
    worker, kernel = incident
    result = CliRunner().invoke(diagnose, [str(worker), str(kernel)])
    assert result.exit_code == 0, result.output
    first, second = result.output.splitlines()
    assert first == f"gpu_xid: Xid 79: GPU has fallen off the bus at {kernel}:1: {XID_79}"
    assert second.startswith(f"cascade: {len(WATCHDOG.splitlines())} line(s)")


def test_cli_reports_unknown_with_exit_zero(tmp_path):
    log = tmp_path / "quiet.log"
    log.write_text(NOISE + "\n")
    result = CliRunner().invoke(diagnose, [str(log)])
    assert result.exit_code == 0
    assert result.output == "unknown: no known failure signature in the logs\n"


def test_cli_reads_stdin():
    result = CliRunner().invoke(diagnose, ["-", "--json"], input=OOM_TRACEBACK.encode() + b"\n\xff\xfe\n")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert payload["root"] == "oom" and payload["source"] == "<stdin>:6"


def test_cli_missing_file_is_a_zaya_error(tmp_path, incident):
    missing = tmp_path / "nope.log"
    result = CliRunner().invoke(diagnose, [str(incident[0]), str(missing)])
    assert isinstance(result.exception, ZayaError)
    assert str(result.exception) == f"{missing}: file not found"
    result = CliRunner().invoke(diagnose, [str(tmp_path)])
    assert isinstance(result.exception, ZayaError) and str(tmp_path) in str(result.exception)


def test_cli_needs_a_log():
    result = CliRunner().invoke(diagnose, [])
    assert result.exit_code == 2 and "LOGS" in result.output
