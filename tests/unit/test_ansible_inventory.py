"""Ansible inventories as ours: INI and YAML written the way Ansible's "How to build your inventory" page
writes them, group_vars/ and host_vars/ beside them, Ansible's precedence, and one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddtree_deploy.errors import InventoryError
from ddtree_deploy.inventory import Inventory, load_inventory, select_hosts

PYTHON = "\n[all:vars]\nansible_python_interpreter=/usr/bin/python3\n"


def write(folder: Path, files: dict[str, str]) -> Path:
    """Write `files` (relative path -> text) under `folder`; the first one is the inventory."""
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder / next(iter(files))


def load(folder: Path, files: dict[str, str]) -> Inventory:
    return load_inventory(str(write(folder, files)))


def error(folder: Path, files: dict[str, str]) -> str:
    with pytest.raises(InventoryError) as info:
        load(folder, files)
    message = str(info.value)
    assert "\n" not in message and info.value.hint
    return message


# The page's first example, word for word, plus the interpreter every host needs.
BASIC_INI = """\
mail.example.com

[webservers]
foo.example.com
bar.example.com

[dbservers]
one.example.com
two.example.com
three.example.com
""" + PYTHON

BASIC_YAML = """\
all:
  vars:
    ansible_python_interpreter: /usr/bin/python3
  hosts:
    mail.example.com:
  children:
    webservers:
      hosts:
        foo.example.com:
        bar.example.com:
    dbservers:
      hosts:
        one.example.com:
        two.example.com:
        three.example.com:
"""


@pytest.mark.parametrize(("name", "text"), [("hosts", BASIC_INI), ("hosts.ini", BASIC_INI), ("hosts.yml", BASIC_YAML)])
def test_the_basic_inventory_in_ini_and_yaml(tmp_path: Path, name: str, text: str) -> None:
    inv = load(tmp_path, {name: text})
    assert list(inv.hosts) == ["mail.example.com", "foo.example.com", "bar.example.com", "one.example.com",
                               "two.example.com", "three.example.com"]
    assert inv.groups() == {"ungrouped": ["mail.example.com"], "webservers": ["foo.example.com", "bar.example.com"],
                            "dbservers": ["one.example.com", "two.example.com", "three.example.com"]}
    host = inv.hosts["foo.example.com"]
    assert host.python == "/usr/bin/python3" and host.transport == "ssh" and host.ssh_alias == "foo.example.com"


# Groups of groups, from the page's "Grouping groups: parent/child group relationships".
GROUPS_INI = """\
[atlanta]
host1
host2

[raleigh]
host2
host3

[southeast:children]
atlanta
raleigh

[southeast:vars]
some_server=foo.southeast.example.com
halon_system_timeout=30
ddtree_deploy={'state_dir': '/srv/southeast', 'env': {'ZONE': 'se'}}

[atlanta:vars]
ddtree_deploy={'state_dir': '/srv/atlanta'}

[usa:children]
southeast
northeast

[northeast]
host4 ddtree_deploy="{'env': {'ZONE': 'ne'}}"
""" + PYTHON


def test_children_groups_hold_their_childrens_hosts_and_pass_vars_down(tmp_path: Path) -> None:
    inv = load(tmp_path, {"hosts.ini": GROUPS_INI})
    assert inv.groups()["southeast"] == ["host1", "host2", "host3"]
    assert inv.groups()["usa"] == ["host1", "host2", "host3", "host4"]
    assert [h.name for h in select_hosts(inv, groups=["southeast"])] == ["host1", "host2", "host3"]
    assert inv.hosts["host1"].groups == ["usa", "southeast", "atlanta"]  # parents before children
    assert inv.hosts["host1"].state_dir == "/srv/atlanta"  # the child group's vars over the parent's
    assert inv.hosts["host3"].state_dir == "/srv/southeast"
    assert inv.hosts["host1"].env == {"ZONE": "se"}  # our mappings merge deeply across groups
    assert inv.hosts["host4"].env == {"ZONE": "ne"}


def test_group_priority_orders_groups_of_one_depth(tmp_path: Path) -> None:
    text = ("[a]\nh1\n[b]\nh1\n[a:vars]\nddtree_deploy={'state_dir': '/a'}\nansible_group_priority=5\n"
            "[b:vars]\nddtree_deploy={'state_dir': '/b'}\n" + PYTHON)
    assert load(tmp_path, {"hosts": text}).hosts["h1"].state_dir == "/a"  # b (priority 1) first, then a
    assert load(tmp_path, {"hosts": text.replace("=5", "=0")}).hosts["h1"].state_dir == "/b"


def test_connection_variables_become_the_host_spec(tmp_path: Path) -> None:
    text = """\
[targets]
localhost              ansible_connection=local
other1.example.com     ansible_connection=ssh        ansible_user=myuser
jumper ansible_port=5555 ansible_host=192.0.2.50 ansible_ssh_private_key_file=keys/id_ed25519
badwolf.example.com:5309
192.0.2.51
""" + PYTHON
    inv = load(tmp_path, {"hosts": text})
    assert inv.hosts["localhost"].transport == "local"
    assert inv.hosts["other1.example.com"].ssh_user == "myuser"
    jumper = inv.hosts["jumper"]
    assert (jumper.ssh_alias, jumper.ssh_port) == ("192.0.2.50", 5555)
    assert jumper.ssh_key == str(tmp_path / "keys" / "id_ed25519")
    assert inv.hosts["badwolf.example.com"].ssh_port == 5309
    assert inv.hosts["192.0.2.51"].ssh_alias == "192.0.2.51"  # a host named by its address connects to it


def test_host_ranges_expand(tmp_path: Path) -> None:
    text = "[webservers]\nwww[01:50].example.com\n[databases]\ndb-[a:f].example.com\n[odd]\nn[1:9:2]\n" + PYTHON
    inv = load(tmp_path, {"hosts": text})
    web = inv.groups()["webservers"]
    assert len(web) == 50 and web[0] == "www01.example.com" and web[-1] == "www50.example.com"
    assert inv.groups()["databases"] == [f"db-{c}.example.com" for c in "abcdef"]
    assert inv.groups()["odd"] == ["n1", "n3", "n5", "n7", "n9"]


def test_group_vars_and_host_vars_beside_the_inventory(tmp_path: Path) -> None:
    inv = load(tmp_path, {
        "inventory/hosts.ini": GROUPS_INI.replace("host2\n\n[raleigh]", "host2 ansible_port=2200\n\n[raleigh]"),
        "inventory/group_vars/all.yml": "ddtree_deploy:\n  service: {kind: process, command: [python3, -m, sglang.launch_server], port: 30000}\n",
        # a folder of files, read in sorted order: the later file wins
        "inventory/group_vars/atlanta/10-base.yml": "ddtree_deploy: {package_root: /opt/a, state_dir: /srv/a-file}\n",
        "inventory/group_vars/atlanta/20-more.yaml": "ddtree_deploy: {package_root: /opt/a2}\n",
        "inventory/group_vars/atlanta/vault": "$ANSIBLE_VAULT;1.1;AES256\n6162636465\n",
        "inventory/group_vars/southeast.yml": "ddtree_deploy: {state_dir: /srv/se-file}\nsecret: !vault |\n  $ANSIBLE_VAULT;1.1;AES256\n  6162\n",
        "inventory/host_vars/host1": "ddtree_deploy: {service: {port: 30001}}\n",  # no extension
        "inventory/host_vars/host2.yaml": "ansible_port: 2201\n",
        "inventory/host_vars/elsewhere.yml": "ddtree_deploy: {colour: red}\n",  # not in the inventory: not read
    })
    host1 = inv.hosts["host1"]
    assert host1.package_root == "/opt/a2"
    # every group's group_vars/ file is over every inventory-file group var, as in Ansible
    assert host1.state_dir == "/srv/a-file"
    assert inv.hosts["host3"].state_dir == "/srv/se-file"
    assert host1.service is not None and host1.service.port == 30001 and host1.service.command[0] == "python3"
    assert inv.hosts["host2"].ssh_port == 2201  # host_vars/ over the inventory file's host vars


def test_the_ddtree_deploy_ssh_variable_of_the_all_group_sets_the_ssh_settings(tmp_path: Path) -> None:
    inv = load(tmp_path, {"hosts.ini": BASIC_INI,
                          "group_vars/all/ssh.yml": "ddtree_deploy_ssh: {known_hosts: keys/known_hosts, connect_timeout_s: 3}\n"})
    assert inv.ssh.known_hosts == str(tmp_path / "keys" / "known_hosts") and inv.ssh.connect_timeout_s == 3


# The page's YAML with children of children and host variables.
CHILDREN_YAML = """\
all:
  vars:
    ansible_python_interpreter: /usr/bin/python3
  children:
    webservers:
      hosts:
        foo.example.com:
        bar.example.com:
    dbservers:
      hosts:
        one.example.com:
        two.example.com:
        three.example.com:
    east:
      hosts:
        foo.example.com:
        one.example.com:
        two.example.com:
    west:
      hosts:
        bar.example.com:
        three.example.com:
    prod:
      children:
        east:
    test:
      children:
        west:
      vars:
        ddtree_deploy: {state_dir: /srv/test}
atlanta:
  hosts:
    host1:
      http_port: 80
      ansible_host: 10.0.0.1
    host2:
      ansible_port: 303
"""


def test_yaml_children_of_children_and_top_level_groups(tmp_path: Path) -> None:
    inv = load(tmp_path, {"hosts.yaml": CHILDREN_YAML})
    assert inv.groups()["prod"] == ["foo.example.com", "one.example.com", "two.example.com"]
    assert inv.groups()["test"] == ["bar.example.com", "three.example.com"]
    assert inv.hosts["bar.example.com"].state_dir == "/srv/test"
    assert inv.hosts["host1"].ssh_alias == "10.0.0.1" and inv.hosts["host2"].ssh_port == 303
    assert inv.hosts["host1"].groups == ["atlanta"]


@pytest.mark.parametrize(
    ("files", "needles"),
    [
        ({"hosts": "[usa:children]\nsoutheast\n" + PYTHON}, ["hosts line 2", "group 'southeast' is never declared"]),
        ({"hosts": "[web:servers]\nh1\n"}, ["hosts line 1", "[web:servers] has an unknown type"]),
        ({"hosts": "[web]\nh1\n[web:vars]\nhttp_port\n"}, ["hosts line 4", "expected key=value"]),
        ({"hosts": "[web]\nh1 http_port\n"}, ["hosts line 2", "expected key=value after the host name"]),
        ({"hosts": "[web]\nh1 a='b\n"}, ["hosts line 2", "cannot read the host line"]),
        ({"hosts": "[web ]\nh1\n"}, ["hosts line 1", "invalid section header"]),
        ({"hosts": "all:\n  hosts:\n"}, ["hosts line 1", "'all:' is not a host name"]),
        ({"hosts": "[web]\nwww[01:5].example.com\n"}, ["hosts line 2", "pads its begin but not its end"]),
        ({"hosts": "[web]\nwww[9:1]\n"}, ["hosts line 2", "must run up"]),
        ({"hosts": "[web]\nwww[1-3]\n"}, ["hosts line 2", "is not [begin:end]"]),
        ({"hosts": "[a:children]\nb\n[b:children]\na\n"}, ["hosts", "is its own ancestor"]),
        ({"hosts": "[web]\nh1 ansible_connection=winrm\n" + PYTHON}, ["hosts line 2", "ansible_connection 'winrm'"]),
        ({"hosts": "[web]\nh1\n[web:vars]\nddtree_deploy_ssh={'config': 'x'}\n"}, ["hosts line 4", "inventory-wide"]),
        ({"hosts": "[web]\nh1\n[web:vars]\nansible_group_priority=high\n"}, ["hosts line 4", "ansible_group_priority"]),
        ({"hosts": "[web]\nh1\n", "group_vars/web.yml": "ddtree_deploy: /srv\n"},
         ["group_vars/web.yml", "ddtree_deploy must be a mapping"]),
        ({"hosts": "[web]\nh1\n", "group_vars/web.yml": "a: [1\n"}, ["group_vars/web.yml", "line", "malformed YAML"]),
        ({"hosts": "[web]\nh1\n"}, ["host h1: field python: Field required"]),
        ({"hosts": "[web]\nh1\n" + PYTHON, "host_vars/h1.yml": "ddtree_deploy: {colour: red}\n"},
         ["host h1: field colour: unknown key", "set in", "host_vars/h1.yml"]),
        ({"hosts": "[web]\nh1 ansible_port=http\n" + PYTHON}, ["host h1: field ssh_port", "set in", "hosts line 2"]),
        ({"hosts": "[web]\nh1 ansible_host=10.0.0.1 ddtree_deploy=\"{'ssh': 'h1'}\"\n" + PYTHON},
         ["host h1: field ssh", "not both"]),
        ({"hosts": "[web]\nh1 ansible_host=-oProxyCommand=x\n" + PYTHON}, ["field ssh_host", "not starting with -"]),
        ({"hosts": "[web]\nh1\n" + PYTHON, "group_vars/all.yml": "ddtree_deploy_ssh: {colour: red}\n"},
         ["ddtree_deploy_ssh: field colour: unknown key", "group_vars/all.yml"]),
        ({"hosts": "# nothing yet\n"}, ["no hosts defined"]),
        ({"hosts.toml": "[web.hosts.h1]\n"}, ["hosts.toml: a TOML inventory is not read"]),
        ({"hosts.yml": "all:\n  host:\n    h1:\n"}, ["group all: unknown key 'host'"]),
        ({"hosts.yml": "all:\n  children: [web]\n"}, ["group all: children must be a mapping"]),
        ({"hosts.yml": "web: [h1]\n"}, ["group web: must be a mapping"]),
        ({"hosts.yml": "web:\n  hosts:\n    h1: 22\n"}, ["host h1: variables must be a mapping"]),
    ],
)
def test_a_bad_ansible_inventory_is_one_line_naming_where(tmp_path: Path, files: dict[str, str], needles: list[str]) -> None:
    message = error(tmp_path, files)
    assert str(tmp_path) in message
    for needle in needles:
        assert needle in message, (needle, message)


def test_our_own_yaml_inventory_is_still_ours(tmp_path: Path) -> None:
    inv = load(tmp_path, {"inventory.yaml": "defaults: {python: /p}\nhosts:\n  all: {}\n"})
    assert list(inv.hosts) == ["all"]
