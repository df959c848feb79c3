"""``python -m registrar``: the same as the ``vllm-registrar`` command."""

from registrar.cli import main

raise SystemExit(main())
