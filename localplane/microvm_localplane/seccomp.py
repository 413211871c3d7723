"""The guests' seccomp profile (OCI `linux.seccomp`), written here as data.

Default: allow. Denied with EPERM: what reaches past a guest's namespaces or
into the kernel's global state, the same families as the usual container
default profiles (which allow-list instead; the effect on this list is the same):

- loading code into the kernel: kexec_*, init/finit/delete_module, bpf,
  perf_event_open, and io_uring (a large attack surface seccomp cannot see into)
- kernel keyrings (not namespaced): keyctl, add_key, request_key
- mounting of any kind, including the new mount API (fsopen, fsconfig,
  fsmount, fspick, move_mount, open_tree, open_tree_attr, mount_setattr): a
  guest has no CAP_SYS_ADMIN anyway; this also covers a nested user
  namespace's mounts
- new user namespaces: unshare/clone with CLONE_NEWUSER; clone3 answers ENOSYS
  so that libcs fall back to clone, whose flags seccomp can check
- host clocks and swap: clock_settime, clock_adjtime, settimeofday, adjtimex,
  swapon, swapoff; reboot, acct, quotactl, syslog
- file handles that bypass path checks: open_by_handle_at, name_to_handle_at
- what moby's default profile gives only with a capability a guest does not
  have: kcmp (CAP_SYS_PTRACE), setns and fanotify_init (CAP_SYS_ADMIN), vhangup
  (CAP_SYS_TTY_CONFIG), the NUMA calls mbind, set_mempolicy, get_mempolicy,
  set_mempolicy_home_node and move_pages (CAP_SYS_NICE)
- raw hardware and obsolete calls: iopl, ioperm, vm86, uselib, ustat, sysfs,
  _sysctl, nfsservctl, lookup_dcookie, userfaultfd
- personality flags that weaken memory protections (READ_IMPLIES_EXEC,
  MMAP_PAGE_ZERO, ADDR_COMPAT_LAYOUT, ADDR_NO_RANDOMIZE)
- socket families other than AF_UNIX, AF_INET, AF_INET6, AF_NETLINK and
  AF_PACKET (which the kernel then refuses for want of CAP_NET_RAW): socket()
  and socketpair() answer EAFNOSUPPORT, as a kernel without the family would.
  Docker's default profile refuses AF_VSOCK only (a guest must never reach the
  host's vsock services); the rest (AF_ALG, AF_TIPC, AF_RDS, AF_XDP,
  Bluetooth...) is kernel code a sandbox has no use for, and a classic route to
  a kernel bug. The x86 `socketcall` multiplexer passes the family in memory,
  where seccomp cannot read it, so its socket and socketpair calls are refused
  the same way; the direct 32-bit calls are filtered by family like the 64-bit
  ones. (Docker allows socketcall, which reaches AF_VSOCK from 32-bit code.) A
  32-bit x86 program whose libc creates sockets through socketcall (glibc
  built for kernels before 4.3) cannot create sockets in a guest.

ptrace stays allowed: a guest only sees its own processes (PID namespace), and
they all belong to its own user namespace, so nothing else can be traced.

runc can only filter a call the host's libseccomp can name: it skips the
others (open_tree_attr, statmount, listmount, mseal... with libseccomp 2.5.4,
whose table ends at futex_requeue), and with a default of "allow" they pass.
An allow list would make runc answer ENOSYS to them, but libseccomp 2.5 takes
about 20 ms a boot to compile one for x86_64, x86 and x32 (6 ms for x86_64
alone) against 1 ms for this list. What they could reach needs CAP_SYS_ADMIN
(a tree clone, a mount) or is the caller's own (its mounts' metadata, its LSM
attributes, its memory), and a guest can neither hold nor gain CAP_SYS_ADMIN
(no new user namespace); with a newer libseccomp they are filtered by name.
See docs/localplane-guests.md.
"""

EPERM = 1
CLONE_NEWUSER = 0x10000000

DENIED = (
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "create_module",
    "get_kernel_syms", "query_module", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "keyctl", "add_key", "request_key",
    "mount", "umount", "umount2", "pivot_root", "fsopen", "fsconfig", "fsmount", "fspick", "move_mount",
    "open_tree", "open_tree_attr", "mount_setattr",
    "clock_settime", "clock_settime64", "clock_adjtime", "clock_adjtime64", "settimeofday", "stime", "adjtimex",
    "swapon", "swapoff", "reboot", "acct", "quotactl", "quotactl_fd", "syslog",
    "open_by_handle_at", "name_to_handle_at",
    "kcmp", "setns", "fanotify_init", "vhangup",
    "mbind", "set_mempolicy", "get_mempolicy", "set_mempolicy_home_node", "move_pages",
    "iopl", "ioperm", "vm86", "vm86old", "uselib", "ustat", "sysfs", "_sysctl", "nfsservctl", "lookup_dcookie",
)

AF_UNIX, AF_INET, AF_INET6, AF_NETLINK, AF_PACKET = 1, 2, 10, 16, 17
ALLOWED_SOCKET_FAMILIES = (AF_UNIX, AF_INET, AF_INET6, AF_NETLINK, AF_PACKET)
AF_MAX = 46             # Linux 6.x; every family at or above it is refused too, known or not
EAFNOSUPPORT = 97
SYS_SOCKET, SYS_SOCKETPAIR = 1, 8   # socketcall(2) call numbers

# personality(2) flags a guest may not set.
PERSONALITY_DENIED_FLAGS = (0x0400000, 0x0100000, 0x0200000, 0x0040000)


def _masked(index, bits):
    """Matches when all `bits` are set in argument `index` (OCI: value = mask, valueTwo = expected)."""
    return {"index": index, "value": bits, "valueTwo": bits, "op": "SCMP_CMP_MASKED_EQ"}


def socket_rules() -> list:
    """socket(family, ...) and socketpair(family, ...): EAFNOSUPPORT unless the family is allowed.

    With a default of "allow", each refused family is one rule (rules for one call are ORed; the arguments of
    one rule are ANDed); the comparison is on the whole 64-bit argument, so a family with high bits set is caught
    by the GE rule rather than truncated by the kernel into an allowed one.
    """
    refused = [f for f in range(AF_MAX) if f not in ALLOWED_SOCKET_FAMILIES]
    rules = []
    for name in ("socket", "socketpair"):
        for family in refused:
            rules.append({"names": [name], "action": "SCMP_ACT_ERRNO", "errnoRet": EAFNOSUPPORT,
                          "args": [{"index": 0, "value": family, "op": "SCMP_CMP_EQ"}]})
        rules.append({"names": [name], "action": "SCMP_ACT_ERRNO", "errnoRet": EAFNOSUPPORT,
                      "args": [{"index": 0, "value": AF_MAX, "op": "SCMP_CMP_GE"}]})
    for call in (SYS_SOCKET, SYS_SOCKETPAIR):
        rules.append({"names": ["socketcall"], "action": "SCMP_ACT_ERRNO", "errnoRet": EAFNOSUPPORT,
                      "args": [{"index": 0, "value": call, "op": "SCMP_CMP_EQ"}]})
    return rules


def profile():
    """The `linux.seccomp` object of a guest's OCI config."""
    syscalls = [{"names": list(DENIED), "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM}]
    # unshare(flags) and clone(flags, ...): refuse CLONE_NEWUSER (flags & CLONE_NEWUSER == CLONE_NEWUSER)
    for name in ("unshare", "clone"):
        syscalls.append({"names": [name], "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM,
                         "args": [_masked(0, CLONE_NEWUSER)]})
    syscalls.append({"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38})  # ENOSYS
    for flag in PERSONALITY_DENIED_FLAGS:
        syscalls.append({"names": ["personality"], "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM,
                         "args": [_masked(0, flag)]})
    syscalls += socket_rules()
    return {"defaultAction": "SCMP_ACT_ALLOW",
            "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
            "syscalls": syscalls}
