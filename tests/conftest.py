"""Suite-wide settings.

Task environments: tests that build a Dockerfile exercise the host-root mode unless they
ask for images (tests/tasks/test_images.py does, explicitly), so the default suite does
not build a podman image per test task; `RIDGELINE_TASK_ENV` set by the caller wins.
"""

import os

os.environ.setdefault("RIDGELINE_TASK_ENV", "host")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def docker_engine(tmp_path_factory):
    """The docker backend's engine: the one DOCKER_HOST names if it answers, else
    podman's Docker-compatible API on a private socket (started here, stopped at the
    end); skips where neither exists. Yields the provider."""
    from ridgeline import sandbox
    from ridgeline.errors import SandboxError
    from ridgeline.tasks.images import ImagesUnavailable, builder

    service = None
    saved = os.environ.get("DOCKER_HOST")
    try:
        try:
            provider = sandbox.get_provider("docker")
        except SandboxError:
            sandbox._providers.pop("docker", None)
            sock = tmp_path_factory.mktemp("podman-api") / "podman.sock"
            try:
                service = builder().api_service(sock)
            except (ImagesUnavailable, SandboxError) as e:
                pytest.skip(f"no Docker engine and no podman API here: {e}")
            os.environ["DOCKER_HOST"] = f"unix://{sock}"
            provider = sandbox.get_provider("docker")
        yield provider
    finally:
        if service is not None:
            sandbox._providers.pop("docker", None)
            if saved is None:
                os.environ.pop("DOCKER_HOST", None)
            else:
                os.environ["DOCKER_HOST"] = saved
            service.terminate()
            service.wait(timeout=30)
