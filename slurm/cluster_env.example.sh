# Cluster-specific settings for pretrain_tst_moe.sbatch: copy this file, edit it for your
# cluster, and submit with CLUSTER_ENV=/path/to/your_cluster.sh. It is sourced by the batch
# script before srun, so what it exports reaches every task. The values below are examples of
# what sites commonly set, not defaults: check them against your cluster's documentation.

# Software environment, if your site uses modules or a specific NCCL build:
# module load cuda/12.8 nccl/2.26

# Which interfaces NCCL and gloo use for bootstrap/TCP traffic (exclude loopback and docker):
# export NCCL_SOCKET_IFNAME=^lo,docker0
# export GLOO_SOCKET_IFNAME=eth0

# InfiniBand (DGX H100-style: 8 compute HCAs per node); RoCE fabrics usually also need a GID index:
# export NCCL_IB_HCA=mlx5_0,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_9,mlx5_10,mlx5_11
# export NCCL_IB_GID_INDEX=3
# export NCCL_IB_TIMEOUT=22

# AWS EFA (p5 instances):
# export FI_PROVIDER=efa
# export FI_EFA_USE_DEVICE_RDMA=1

# More NCCL logging while bringing a cluster up (the template's default is WARN):
# export NCCL_DEBUG=INFO
# export NCCL_DEBUG_SUBSYS=INIT,NET
