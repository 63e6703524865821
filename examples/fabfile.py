"""A team's own fabfile with patchctl's tasks in it (the `patchctl[fabric]` extra).

    fab -r examples --list
    fab -r examples -H gpu-a,gpu-b patchctl.apply --series hidden-dump     # one patchctl run over both hosts
    fab -r examples -H gpu-a,gpu-b patchctl.status
    TEAM_GPU_HOSTS=gpu-a,gpu-b fab -r examples fleet-status               # the team's task, its own host list

Hosts are the inventory's (./inventory.toml, $PATCHCTL_INVENTORY or --inventory FILE on each task), or any
`-H` host, which gets the inventory's [defaults] and the Connection's user, port, key and gateway.
"""

import os

from fabric import Group, task
from invoke import Collection

from patchctl.fabric import fleet
from patchctl.fabric import ns as patchctl


@task
def fleet_status(c, inventory=None):
    """Status of the team's GPU hosts ($TEAM_GPU_HOSTS), one patchctl run over all of them."""
    hosts = [h for h in os.environ.get("TEAM_GPU_HOSTS", "gpu-a,gpu-b").split(",") if h]
    fleet("status", Group(*hosts, config=c.config), inventory=inventory)


ns = Collection(fleet_status)
ns.add_collection(patchctl, name="patchctl")
