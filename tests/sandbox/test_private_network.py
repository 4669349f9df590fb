"""PrivateNetwork (sandbox/network.py): a loopback shared by a group of sandboxes only."""

from __future__ import annotations

import time

from ridgeline.sandbox import Mount, SandboxSpec, create_sandbox
from ridgeline.sandbox.network import PrivateNetwork, hosts_file

from tests.helpers.sandbox_helpers import needs_bwrap, needs_root

pytestmark = [needs_bwrap, needs_root]
GET = ("import sys, urllib.request\ntry:\n print(urllib.request.urlopen(sys.argv[1], "
       "timeout=3).status)\nexcept OSError as e: print('NO', e)")


def test_members_reach_each_other_by_name_and_nothing_else():
    with PrivateNetwork() as net:
        hosts = hosts_file(net.dir, ["api", "client"])
        spec = SandboxSpec(network_namespace=net.path,
                           mounts=[Mount(source=hosts, target="/etc/hosts")])
        with create_sandbox(spec) as api, create_sandbox(spec) as client, \
                create_sandbox(SandboxSpec()) as stranger:
            api.run("nohup python3 -m http.server 8080 >/dev/null 2>&1 &")
            for _ in range(50):
                if client.run(["python3", "-c", GET, "http://api:8080/"]).stdout == "200\n":
                    break
                time.sleep(0.1)
            assert client.run(["python3", "-c", GET, "http://api:8080/"]).stdout == "200\n"
            # A sandbox outside the group has its own empty network.
            assert stranger.run(["python3", "-c", GET, "http://127.0.0.1:8080/"]
                                ).stdout.startswith("NO")
            # The group reaches nothing outside it.
            assert client.run(["python3", "-c", GET, "http://1.1.1.1/"]).stdout.startswith("NO")
    assert not net.path.exists()


def _registry_reachable() -> bool:
    import socket
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
        return True
    except OSError:
        return False


def test_internet_reaches_out_but_never_the_host():
    """With internet (slirp4netns), a sandbox reaches the internet through NAT; the host's
    addresses, slirp's gateway (the host's loopback) and link-local metadata stay out."""
    import socket

    from ridgeline.sandbox.network import host_addresses, resolv_conf
    srv = socket.socket()
    srv.bind(("0.0.0.0", 0))   # a host service on every address
    srv.listen(4)
    port = srv.getsockname()[1]
    try:
        with PrivateNetwork(internet=True) as net:
            spec = SandboxSpec(network_namespace=net.path,
                               mounts=[Mount(source=resolv_conf(net.dir),
                                             target="/etc/resolv.conf")])
            with create_sandbox(spec) as sb:
                assert sb.run("cat /etc/resolv.conf").stdout == "nameserver 10.0.2.3\n"
                for host in [*host_addresses(), "10.0.2.2", "127.0.0.1"]:
                    out = sb.run(["python3", "-c", GET, f"http://{host}:{port}/"]).stdout
                    assert out.startswith("NO"), (host, out)
                assert sb.run(["python3", "-c", GET, "http://169.254.169.254/"]
                              ).stdout.startswith("NO")
                if _registry_reachable():   # what this machine itself can reach
                    assert sb.run(["python3", "-c", GET, "https://pypi.org/simple/"]
                                  ).stdout == "200\n"
            slirp = net.slirp
        assert slirp.poll() is not None and net.slirp is None   # NAT stopped with it
        assert not net.path.exists()
    finally:
        srv.close()
