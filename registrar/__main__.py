"""``python -m registrar``: the same as the ``vllm-registrar`` command."""

from vllm_etcd_proxy.registrar.cli import main

raise SystemExit(main())
