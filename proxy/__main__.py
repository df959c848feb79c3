from vllm_etcd_proxy.proxy.cli import main

if __name__ == "__main__":
    main()
