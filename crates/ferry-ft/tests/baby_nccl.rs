//! The Baby group's NCCL backend (`Backend::Nccl`).
//!
//! With the `nccl` feature: replica groups on one host allreduce through
//! NCCL children, one CUDA device each (one group on a one-GPU host, two
//! on a host with two or more); skipped, with the reason, on a host
//! without the CUDA driver, NCCL or a device. Without the feature: a child
//! asked for NCCL fails its start-up with a typed error naming the
//! feature.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use ferry_ft::baby::{BabyOptions, BabyProcessGroup, Backend};
use ferry_store::TcpStoreServer;

const T: Duration = Duration::from_secs(60);

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn options(rank: usize, device: u32) -> BabyOptions {
    BabyOptions::new(format!("replica_{rank}"))
        .with_timeout(T)
        .with_backend(Backend::Nccl { device })
}

#[cfg(not(feature = "nccl"))]
#[test]
fn without_the_feature_a_nccl_child_fails_its_start_up() {
    use ferry_ft::baby::BabyError;
    runtime().block_on(async {
        let server = TcpStoreServer::bind(([127, 0, 0, 1], 0).into()).await.unwrap();
        let store = server.local_addr().to_string();
        let mut pg = BabyProcessGroup::new(options(0, 0));
        let error = pg
            .configure_with(&store, 1, &["replica_0".to_owned()], 0)
            .await
            .unwrap_err();
        assert!(
            matches!(&error, BabyError::ChildFailed { message, .. } if message.contains("`nccl` feature")),
            "{error}"
        );
        pg.shutdown().await;
    });
}

#[cfg(feature = "nccl")]
#[test]
fn nccl_children_allreduce_like_the_reference() {
    use ferry_ft::collective::ReduceOp;

    let devices = match ferry_ft::baby::nccl_availability() {
        Ok(n) => n,
        Err(reason) => {
            eprintln!("SKIPPED: the NCCL backend needs CUDA and NCCL: {reason}");
            return;
        }
    };
    // NCCL takes one device per rank.
    let world = devices.min(2);
    runtime().block_on(async {
        let server = TcpStoreServer::bind(([127, 0, 0, 1], 0).into())
            .await
            .unwrap();
        let store = server.local_addr().to_string();
        let ids: Vec<String> = (0..world).map(|r| format!("replica_{r}")).collect();
        let mut groups: Vec<BabyProcessGroup> = (0..world)
            .map(|r| BabyProcessGroup::new(options(r, r as u32)))
            .collect();
        for quorum in [1, 2] {
            let configured = futures::future::join_all(
                groups
                    .iter_mut()
                    .enumerate()
                    .map(|(r, pg)| pg.configure_with(&store, quorum, &ids, r as u64)),
            )
            .await;
            for result in configured {
                result.unwrap();
            }
            let len = (1 << 20) + 3;
            let mut buffers = Vec::new();
            for (r, pg) in groups.iter().enumerate() {
                let mut buffer = pg.buffer(len).unwrap();
                for (i, x) in buffer.iter_mut().enumerate() {
                    *x = (r + 1) as f32 * (i % 7) as f32;
                }
                buffers.push(buffer);
            }
            let works: Vec<_> = groups
                .iter()
                .zip(buffers)
                .map(|(pg, buffer)| pg.allreduce_buffer(buffer, ReduceOp::Sum))
                .collect();
            let scale: usize = (1..=world).sum();
            for result in futures::future::join_all(works).await {
                let buffer = result.map_err(|failure| failure.error).unwrap();
                for (i, x) in buffer.iter().enumerate() {
                    assert_eq!(*x, (scale * (i % 7)) as f32, "element {i}");
                }
            }
        }
        for pg in groups {
            pg.shutdown().await;
        }
    });
}
