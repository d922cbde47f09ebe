from .fixtures import fake_lab  # noqa: F401


def pytest_configure(config):
    config.addinivalue_line("markers", "lab: tests that start fake hosts (root, netns, sshd)")
