"""Shinken: sync-first sandbox SDK (shinken_sync + shinkend) and the session server (webapp).

Each runtime dependency is chosen for a stated reason; see docs/dependencies.md.
"""

import re

from setuptools import find_packages, setup

# The one version: shinken_sync.__version__ (every CLI's --version prints it); read, not imported.
VERSION = re.search(r'^__version__ = "([^"]+)"', open("shinken_sync/__init__.py", encoding="utf-8").read(), re.M)[1]

# Three tiers, each layer's own (docs/architecture.md, Layers; docs/dependencies.md says why each).
# The SDK (shinken_sync without its demo) and the daemon shinkend:
SDK = [
    "websockets>=14.1,<18",  # 14.0's asyncio client has no close_code/close_reason (tox env oldest)
    "Pillow>=10.2",  # 10.0/10.1 ignore JPEG restart markers: shinkend's splicing (tox env oldest)
    "requests>=2.31,<3",  # shinken_sync.fleet_view publishes a fleet's frames to the viewer
]
# The session server, webapp:
SERVER = [
    "gevent>=26.5",  # older ones print a traceback at every worker exit (tox env oldest; docs/dependencies.md)
    "flask>=3.0,<4",
    "gunicorn[gevent]>=23,<28",  # the extra brings packaging, which gunicorn 27's gevent worker imports
    "setproctitle>=1.3,<2",
    "numpy>=1.24",
    "safetensors>=0.4",
    "pybase64>=1.3",  # the records GET and each turn's R3 check are base64-bound (docs/dependencies.md)
    "blake3>=1.0,<2",  # each turn hashes every known screenshot's URL text (docs/dependencies.md)
    "urllib3>=2,<3",  # the engine client drives requests' transport directly (docs/dependencies.md)
    "certifi",  # its CA bundle when none is named, as requests took it
]
# The demo, above both: the session server's stack plus its progress bar and tables.
DEMO = [
    "tqdm>=4.66,<5",
    "tabulate>=0.9,<1",
]

setup(
    name="shinken",
    version=VERSION,
    description="Rollout infrastructure for computer-use agents: a sync-first sandbox SDK "
    "and a token-exact session server.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["shinken_sync", "shinken_sync.*", "webapp", "webapp.*"]),
    package_data={"webapp": ["gunicorn.conf.py", "viewer_static/*"], "shinken_sync.daemon.display": ["openbox-rc.xml"]},
    # The SDK and shinkend alone: `pip install shinken` brings no server and no demo stack.
    install_requires=SDK,
    extras_require={
        # The session server (webapp) and the demo (shinken_sync.demo: the server, tqdm and tabulate).
        "server": SERVER,
        "demo": SERVER + DEMO,
        "xvfb": ["mss>=10.2,<11"],  # mss.MSS, which the Xvfb backend opens, is new in 10.2 (tox env oldest)
        # Accelerated transport (shinken_sync.transport): picows' Cython WebSocket
        # client and uvloop for the SharedLoop; chosen at connect when installed.
        # uvloop before 0.23 gives each loop an io_uring polling kernel thread (tox env oldest).
        "fast": ["picows>=2.3,<3", "uvloop>=0.23"],
        # tokenizers 0.15.0 ignores encode_special_tokens (field text became control tokens)
        "hf": ["tokenizers>=0.15.1", "Jinja2>=3.1.2"],
        # RayProvider and `shinken demo --ray` (docs/scale-out.md); plain ray: no dashboard, no extras.
        "ray": ["ray>=2.40,<3"],
        "test": SERVER + DEMO + [
            "pytest>=8",
            "pytest-timeout>=2.3",
            "websocket-client>=1.7,<2",
            "openai>=1.30",
            # the official Anthropic client, against the Messages route (tests/webapp/test_anthropic.py)
            "anthropic>=0.40",
            "mss>=10.2,<11",
            "tokenizers>=0.15.1",
            "Jinja2>=3.1.2",
            "psutil>=5.9",
            "pydantic>=2",
            # Docker's own Dockerfile parser (Go, in the wheel): the desktop image's
            # Dockerfile is checked without a Docker daemon (tests/desktop/test_desktop_image.py).
            "dockerfile>=3.3,<4",
        ],
        "lint": ["ruff==0.17.6", "mypy==2.4.1"],
    },
    entry_points={
        "console_scripts": [
            "shinken=shinken_sync.cli:main",
            "shinkend=shinken_sync.daemon.server:main",
            "shinken-session-server=webapp.serve:main",
        ]
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Operating System :: POSIX :: Linux",
    ],
)
