"""Session fixture of the e2e tests: `boots` (tests/e2e/e2e_configs.py), one boot per configuration."""
import pytest

from e2e.e2e_configs import Boots


@pytest.fixture(scope="session")
def boots():
    return Boots()
