//! The harness's placement of ranks on separate hosts: ranks of one host
//! share its namespaces, ranks of different hosts share none, and each
//! rank is told its host and the address of host 0. Skips (printing why)
//! where hosts cannot be made.
#![allow(clippy::unwrap_used)]

use ferry_testkit::{world_on_hosts, Output};

const TEST: &str = "ranks_are_placed_on_their_hosts";
const KINDS: [&str; 5] = ["net", "ipc", "pid", "uts", "mnt"];

fn namespaces() -> Vec<String> {
    KINDS
        .iter()
        .map(|k| {
            std::fs::read_link(format!("/proc/self/ns/{k}"))
                .unwrap()
                .to_string_lossy()
                .into_owned()
        })
        .collect()
}

fn value(o: &Output, key: &str) -> String {
    let v = o.values(key);
    assert_eq!(v.len(), 1, "{key} in {}", o.stdout);
    v[0].clone()
}

#[test]
fn ranks_are_placed_on_their_hosts() {
    // Ranks 0 and 1 on host 0, rank 2 on host 1.
    let Some(outputs) = world_on_hosts(
        TEST,
        3,
        2,
        |r| usize::from(r == 2),
        |_rank| {
            println!("HOST={}", ferry_testkit::this_host().unwrap());
            println!("MASTER={}", std::env::var("MASTER_ADDR").unwrap());
            println!("NS={}", namespaces().join(","));
            let name = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
            println!("NAME={}", name.trim());
            // The working directory is kept across the mount namespace.
            println!("CWD={}", std::env::current_dir().unwrap().display());
        },
    ) else {
        return;
    };
    for (rank, o) in outputs.iter().enumerate() {
        assert!(o.success, "rank {rank}: {}\n{}", o.stdout, o.stderr);
        assert_eq!(value(o, "MASTER"), "10.77.1.1");
        assert_eq!(
            value(o, "CWD"),
            std::env::current_dir().unwrap().display().to_string()
        );
    }
    let host: Vec<String> = outputs.iter().map(|o| value(o, "HOST")).collect();
    assert_eq!(host, ["0", "0", "1"]);
    let name: Vec<String> = outputs.iter().map(|o| value(o, "NAME")).collect();
    assert_eq!(name, ["ferry-host-0", "ferry-host-0", "ferry-host-1"]);
    let ns: Vec<Vec<String>> = outputs
        .iter()
        .map(|o| value(o, "NS").split(',').map(String::from).collect())
        .collect();
    let parent = namespaces();
    for k in 0..KINDS.len() {
        assert_eq!(
            ns[0][k], ns[1][k],
            "ranks 0 and 1 share host 0's {}",
            KINDS[k]
        );
        assert_ne!(ns[0][k], ns[2][k], "hosts 0 and 1 share a {}", KINDS[k]);
        for (rank, n) in ns.iter().enumerate() {
            assert_ne!(n[k], parent[k], "rank {rank} is in the test's {}", KINDS[k]);
        }
    }
}
