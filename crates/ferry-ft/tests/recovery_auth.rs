//! A checkpoint server holding the group's secret serves only healing
//! replicas that prove they hold it: an outsider process with another
//! secret, with none, or replaying a member's captured handshake gets no
//! manifest and no chunk, and is refused with a warning naming its
//! address, while a member heals from the same source. Three processes on
//! 127.0.0.1; they find each other through a plain store the source
//! process hosts for the test (state, not time).
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::time::Duration;

use ferry_ft::recovery::{
    fetch_checkpoint, CheckpointServer, CheckpointServerOptions, CheckpointState, FetchOptions,
};
use ferry_store::{Store, TcpStore, TcpStoreServer};
use ferry_testkit::world_ok;
use ferry_transport::auth::{AuthMessage, Handshake, Role, Secret};
use ferry_transport::RawTensor;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const T: Duration = Duration::from_secs(30);

fn group_secret() -> Secret {
    Secret::new(b"the replica groups' shared secret".to_vec()).unwrap()
}

fn state() -> CheckpointState {
    let w: Vec<f32> = (0..10_000).map(|i| i as f32).collect();
    CheckpointState::new(5).with_tensor("w", RawTensor::from_slice(&w, &[10_000]).unwrap())
}

/// What a member writes in a handshake (its hello and proof), as an
/// eavesdropper would capture it.
fn captured_handshake() -> Vec<u8> {
    let key = group_secret().key().clone();
    let member = Handshake::new(Role::Connect, key.clone(), [1; 32]);
    let mut listener = Handshake::new(Role::Accept, key, [2; 32]);
    let mut member = member;
    let hello = member.start().unwrap();
    let challenge = listener.receive(hello.clone()).send.unwrap();
    let proof = member.receive(challenge).send.unwrap();
    [hello.encode(), proof.encode()].concat()
}

fn log_warnings() {
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .try_init();
}

fn master() -> SocketAddr {
    format!("127.0.0.1:{}", std::env::var("MASTER_PORT").unwrap())
        .parse()
        .unwrap()
}

#[test]
fn an_outsider_cannot_take_part_in_recovery_and_a_member_heals_meanwhile() {
    let outputs = world_ok(
        "an_outsider_cannot_take_part_in_recovery_and_a_member_heals_meanwhile",
        3,
        |rank| {
            log_warnings();
            let rt = tokio::runtime::Runtime::new().unwrap();
            rt.block_on(async {
                let _coordination = if rank == 0 {
                    Some(TcpStoreServer::bind(master()).await.unwrap())
                } else {
                    None
                };
                let store = TcpStore::connect(master(), T).await.unwrap();
                match rank {
                    0 => {
                        let source = CheckpointServer::bind(
                            "127.0.0.1:0",
                            CheckpointServerOptions::new("source").with_auth_secret(group_secret()),
                        )
                        .await
                        .unwrap();
                        source.allow(state()).unwrap();
                        store
                            .set("source", source.address().into_bytes())
                            .await
                            .unwrap();
                        store
                            .wait(&["healed".into(), "outsider/done".into()], T)
                            .await
                            .unwrap();
                        // Only the member's fetch got a manifest.
                        println!("MANIFESTS={}", source.stats().manifests);
                        source.shutdown().await;
                    }
                    1 => {
                        store.wait(&["source".into()], T).await.unwrap();
                        let source = String::from_utf8(store.get("source").await.unwrap()).unwrap();
                        // The member heals while the outsider tries.
                        let options = FetchOptions::new("member")
                            .with_wait(T)
                            .with_auth_secret(group_secret());
                        let got = fetch_checkpoint(&source, 5, &options).await.unwrap();
                        assert_eq!(got, state());
                        println!("HEALED=5");
                        store.set("healed", Vec::new()).await.unwrap();
                    }
                    _ => {
                        store.wait(&["source".into()], T).await.unwrap();
                        let source = String::from_utf8(store.get("source").await.unwrap()).unwrap();
                        let wrong =
                            Secret::new(b"a guess at the shared secret....".to_vec()).unwrap();
                        let with_wrong = FetchOptions::new("outsider")
                            .with_connect_timeout(T)
                            .with_auth_secret(wrong);
                        let e = fetch_checkpoint(&source, 5, &with_wrong).await.unwrap_err();
                        assert!(e.to_string().contains("authentication"), "{e}");
                        let with_none = FetchOptions::new("outsider").with_connect_timeout(T);
                        assert!(fetch_checkpoint(&source, 5, &with_none).await.is_err());
                        // A replayed handshake: answered with a challenge over
                        // a fresh nonce, then refused.
                        let mut raw = tokio::net::TcpStream::connect(&source).await.unwrap();
                        raw.write_all(&captured_handshake()).await.unwrap();
                        let mut back = Vec::new();
                        tokio::time::timeout(T, raw.read_to_end(&mut back))
                            .await
                            .unwrap()
                            .unwrap();
                        assert_eq!(&back[back.len() - 6..], &AuthMessage::Refused.encode()[..]);
                        println!("OUTSIDER=refused");
                        store.set("outsider/done", Vec::new()).await.unwrap();
                    }
                }
                // The coordination store stays up until the others are done
                // with it (their last `set` is answered before they exit).
                if rank == 0 {
                    let others: Vec<String> = (1..3).map(|r| format!("done/{r}")).collect();
                    store.wait(&others, T).await.unwrap();
                } else {
                    store
                        .set(&format!("done/{rank}"), Vec::new())
                        .await
                        .unwrap();
                }
            });
        },
    );
    let Some(outputs) = outputs else { return };
    assert_eq!(outputs[1].values("HEALED"), ["5"]);
    assert_eq!(outputs[2].values("OUTSIDER"), ["refused"]);
    assert_eq!(outputs[0].values("MANIFESTS"), ["1"]);
    let log = &outputs[0].stderr;
    // The first refusal is a line of its own; the others are counted into
    // a summary (within 10 s, or as the server shuts down).
    let refused: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("refused a healing replica that failed authentication"))
        .collect();
    let count: u64 = refused
        .iter()
        .map(|l| {
            let at = l.find("refusals=").expect("a count") + "refusals=".len();
            let n: String = l[at..].chars().take_while(char::is_ascii_digit).collect();
            n.parse::<u64>().unwrap()
        })
        .sum();
    assert!(count >= 3, "{log}");
    assert!(refused.iter().all(|l| l.contains("127.0.0.1:")), "{log}");
}
