# Sourced by the multi-process tests: free_port prints a TCP port for a job's
# master. Picked outside the kernel's ephemeral range, where gloo's and NCCL's
# listeners and every outgoing connection get their ports: a port from that
# range (what binding port 0 gives) can be handed to one of them between the
# pick and the job's own bind, and two jobs of tests running side by side under
# ctest could then meet in one store. Random, so that parallel tests do not pick
# alike, and free when picked. CHORUS_TEST_PORTS=A-B picks from A..B instead
# (a share of the ports given to one of several people testing on a machine).
free_port() {
  python3 - <<'PY'
import os, random, socket
lo, hi = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
pool = list(range(20000, lo)) if lo > 21000 else list(range(hi + 1, 65535))
if os.environ.get("CHORUS_TEST_PORTS"):
    a, b = (int(x) for x in os.environ["CHORUS_TEST_PORTS"].split("-"))
    pool = list(range(a, b + 1))
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
