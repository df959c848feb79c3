from vllm_etcd_proxy.sim.cli import main

main()
