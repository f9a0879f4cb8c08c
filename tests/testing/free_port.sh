# Sourced by the multi-process tests: free_port prints a TCP port for a job's
# master. Picked outside the kernel's ephemeral range, where gloo's and NCCL's
# listeners and every outgoing connection get their ports: a port from that
# range (what binding port 0 gives) can be handed to one of them between the
# pick and the job's own bind, and two jobs of tests running side by side under
# ctest could then meet in one store. Random, so that parallel tests do not pick
# alike, and free when picked.
free_port() {
  python3 - <<'PY'
import random, socket
lo, hi = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
pool = list(range(20000, lo)) if lo > 21000 else list(range(hi + 1, 65535))
for p in random.sample(pool, min(200, len(pool))):
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", p))
    except OSError:
        continue
    finally:
        s.close()
    print(p)
    break
PY
}
