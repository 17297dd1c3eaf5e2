"""Private state stays private in core/, ports/, adapters/ and wiring/ (tests/private_state.py),
and each check catches what it is for."""

from pathlib import Path

from tests.private_state import borrowed_state, private_imports, reached_into
from tests.support.trees import write_tree

ROOT = Path(__file__).resolve().parents[2]


def test_the_repository_imports_no_private_name_across_modules():
    assert private_imports(ROOT) == []


def test_no_class_uses_private_state_it_does_not_define():
    assert borrowed_state(ROOT) == []


def test_no_code_reads_another_objects_private_state():
    assert reached_into(ROOT) == []


def test_a_private_import_is_caught(tmp_path):
    root = write_tree(tmp_path, {"adapters/a/m.py": "from rollout_fleet.adapters.a.n import _helper, ok\n"
                                                    "from os import _exit\n"})
    assert private_imports(root) == ["adapters/a/m.py:1: imports _helper from rollout_fleet.adapters.a.n"]


def test_a_mixin_leaning_on_its_hosts_fields_is_caught(tmp_path):
    root = write_tree(tmp_path, {"adapters/a/m.py": """\
        class Refit:
            def refit(self):
                return self._engine.load(self._weights)

        class Engine(Refit):
            _weights = None

            def __init__(self):
                self._engine = object()
        """})
    assert sorted(borrowed_state(root)) == [
        "adapters/a/m.py:3: Refit uses self._engine, which it does not define",
        "adapters/a/m.py:3: Refit uses self._weights, which it does not define"]


def test_a_part_handed_its_shared_state_passes(tmp_path):
    root = write_tree(tmp_path, {"adapters/a/m.py": """\
        class Refit:
            def __init__(self, runtime):
                self.runtime = runtime
                self._joined = False

            def refit(self):
                self._joined = True
                return self.runtime.engine
        """})
    assert borrowed_state(root) == [] and reached_into(root) == []


def test_reading_another_objects_private_field_is_caught_outside_its_class(tmp_path):
    root = write_tree(tmp_path, {"wiring/w.py": """\
        class Counter:
            def __init__(self):
                self._counts = {}

            def merged(self, other):
                return {**self._counts, **other._counts}  # its own class: allowed

        def report(counter):
            return counter._counts
        """})
    assert reached_into(root) == ["wiring/w.py:9: reads counter._counts"]
