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
