"""Machine tokens: each agent's own API token, made from the API's, which speaks for one machine
(the API's side is in tests/test_api.py, on a live stack)."""

from __future__ import annotations

import pytest

from workers.cli import main
from workers.settings import MACHINE_HEADER, api_headers, load_settings, machine_token


def test_a_machine_token_is_the_same_for_one_machine_and_differs_between_machines_and_secrets():
    token = machine_token("s3cret", "c1/b0/r0/m0")
    assert token == machine_token("s3cret", "c1/b0/r0/m0")
    assert token != machine_token("s3cret", "c1/b0/r0/m1")
    assert token != machine_token("other", "c1/b0/r0/m0")
    assert "s3cret" not in token and token.startswith("machine-")


def test_an_agent_names_its_machine_beside_its_token(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUSCHED_API_TOKEN", "tok")
    settings = load_settings(tmp_path)
    assert api_headers(settings) == {"Authorization": "Bearer tok"}
    assert api_headers(settings, "c1/b0/r0/m0") == {"Authorization": "Bearer tok", MACHINE_HEADER: "c1%2Fb0%2Fr0%2Fm0"}


def test_each_generation_of_a_machine_s_token_is_another_token_and_generation_0_is_the_first_made():
    tokens = [machine_token("s3cret", "c1/b0/r0/m0", generation) for generation in range(4)]
    assert len(set(tokens)) == 4 and all(t.startswith("machine-") for t in tokens)
    assert tokens[0] == machine_token("s3cret", "c1/b0/r0/m0")  # agents started before renewals keep theirs
    # The generation is not run into the id: machine m1 at generation 0 is not m at generation 1.
    assert machine_token("s3cret", "c1/b0/r0/m1") != machine_token("s3cret", "c1/b0/r0/m", 1)


REFUSED = [
    ("no API token is known here", None, "c1/b0/r0/m0", "the API has no token here"),
    ("a blank machine", "s3cret", "/", "is no machine"),
    ("a machine with a control character", "s3cret", "c1/b0/r0/m\x07", "is no machine"),
    ("a machine's token given as the API's", "machine-" + "0" * 64, "c1/b0/r0/m0", "is a machine's token"),
    # Before, each was renewed in the store (a name past the key's index was a traceback):
    # no agent could ever speak for such a machine.
    ("a machine that is no topology path", "s3cret", "c1/m0", "is not a topology path cluster/block/rack/machine"),
    ("a machine name longer than ids take", "s3cret", "c1/b0/r0/" + "m" * 3000, "up to 64 printable characters"),
]


@pytest.mark.parametrize("what,secret,machine,message", REFUSED, ids=[r[0] for r in REFUSED])
def test_gpusched_fleet_token_refuses_with_exit_2(monkeypatch, tmp_path, capsys, what, secret, machine, message):
    monkeypatch.delenv("GPUSCHED_API_TOKEN", raising=False)
    if secret is not None:
        monkeypatch.setenv("GPUSCHED_API_TOKEN", secret)
    assert main(["fleet", "token", machine, "--data-dir", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""
