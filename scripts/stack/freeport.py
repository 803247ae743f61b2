#!/usr/bin/env python3
"""Print N free TCP ports on 127.0.0.1, one per line, chosen BELOW the
kernel's ephemeral range (net.ipv4.ip_local_port_range).

A port from the ephemeral range (what bind(0) returns) can be taken while a
server is stopped: by any outgoing connection's local port, or by a client
that keeps dialling the stopped server and connects to itself (TCP
simultaneous open). The tests stop and restart servers on the same port, so
ports are taken from below that range, where the kernel never assigns them.
"""
import random
import socket
import sys

n = int(sys.argv[1]) if len(sys.argv) > 1 else 1
try:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
except OSError:
    low = 32768
lo, hi = 10000, max(low - 1, 10001 + 4 * n)
ports, held = [], []
for _ in range(10000):
    if len(ports) == n:
        break
    p = random.randint(lo, hi)
    if p in ports:
        continue
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("127.0.0.1", p))
    except OSError:
        s.close()
        continue
    held.append(s)
    ports.append(p)
for s in held:
    s.close()
if len(ports) < n:
    sys.exit("freeport: no free port found below the ephemeral range")
print("\n".join(str(p) for p in ports))
