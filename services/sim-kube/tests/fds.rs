//! Clusters started in process hold no file descriptor, however many there are: the region
//! simulator runs thousands of them in one process. A test binary of its own, so that no other
//! test opens or closes descriptors while it counts them.

use std::time::Duration;

use sim_kube::{Cluster, ClusterConfig};

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd (Linux)")
        .count()
}

/// The open descriptors once their count stands still from one look to the next: descriptors a
/// request leaves (a connection closing) go on the runtime's own schedule, so the count is read
/// once that has run its course, however long it takes.
async fn settled_fds() -> usize {
    let mut last = None;
    test_support::eventually(
        Duration::from_secs(10),
        "the open file descriptors to settle",
        async || {
            let now = open_fds();
            let settled = (last == Some(now)).then_some(now);
            last = Some(now);
            settled
        },
    )
    .await
}

async fn version(cluster: &Cluster) -> http::StatusCode {
    let req = http::Request::get("/version")
        .body(axum::body::Body::empty())
        .unwrap();
    cluster.call(req).await.status()
}

#[tokio::test]
async fn many_in_process_clusters_do_not_grow_the_open_file_descriptors() {
    // Warm up whatever the runtime opens once (timers, the blocking pool).
    let warm = Cluster::start_in_process("warm", ClusterConfig::default()).unwrap();
    assert_eq!(version(&warm).await, 200);
    let before = settled_fds().await;

    let mut clusters = Vec::new();
    for i in 0..300 {
        let c = Cluster::start_in_process(&format!("c{i}"), ClusterConfig::default()).unwrap();
        assert_eq!(version(&c).await, 200);
        clusters.push(c);
    }
    let with_300 = settled_fds().await;
    assert!(
        with_300 <= before + 4,
        "300 in-process clusters: {before} -> {with_300} open file descriptors"
    );

    // The count does see sockets: clusters that listen hold one each.
    let mut listening = Vec::new();
    for i in 0..20 {
        listening.push(
            Cluster::start(&format!("l{i}"), ClusterConfig::default())
                .await
                .unwrap(),
        );
    }
    let with_listeners = open_fds();
    assert!(
        with_listeners >= with_300 + 20,
        "20 listening clusters: {with_300} -> {with_listeners}"
    );
    for c in clusters.iter().chain(&listening) {
        c.shutdown().await;
    }
}
