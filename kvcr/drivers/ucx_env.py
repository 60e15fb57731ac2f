"""UCX settings for peers on one host (tests, the demo): shared memory and TCP on loopback, errors
handled per endpoint, large TCP segments, and no warnings about variables another build lacks."""

SINGLE_HOST_UCX_ENV = {"UCX_TLS": "sm,tcp", "UCX_NET_DEVICES": "lo", "UCX_POSIX_ERROR_HANDLING": "y",
                       "UCX_SYSV_ERROR_HANDLING": "y", "UCX_TCP_TX_SEG_SIZE": "256k", "UCX_TCP_RX_SEG_SIZE": "256k",
                       "UCX_WARN_UNUSED_ENV_VARS": "n"}
