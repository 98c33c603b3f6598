//! The c10d side of [`TcpStoreServer`](crate::TcpStoreServer): serves one
//! connection whose first bytes were c10d's `VALIDATE`, over the same
//! state and quota as Ferry's own clients.
//!
//! [`Session`] is the protocol (pure: queries in, replies and waits
//! out); [`serve_c10d`] is the thin shell that moves bytes.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use futures::FutureExt;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tracing::{debug, warn};

use super::wire::{self, C10dFormatError, Query, QueryType, Reply, WaitReply, VALIDATION_MAGIC};
use crate::quota::{ConnId, QuotaBound, Refusal};
use crate::tcp::served::{closing, Served};
use crate::StoreError;

/// A c10d `WAIT` has no timeout on the server (the client cancels it);
/// this only keeps the deadline arithmetic finite.
const UNBOUNDED_WAIT: Duration = Duration::from_secs(365 * 24 * 3600);

/// Why a c10d connection is closed (c10d has no error replies: the
/// client sees its connection end).
#[derive(Debug, thiserror::Error)]
pub(crate) enum Refused {
    /// Bytes that are not a query, or a client that broke the protocol.
    #[error(transparent)]
    Format(#[from] C10dFormatError),
    /// A write beyond a [`StoreLimits`](crate::StoreLimits) bound.
    #[error("{key:?}: the {bound} limit is {limit}, the request needs {requested}")]
    Quota {
        /// The bound.
        bound: QuotaBound,
        /// The key.
        key: String,
        /// The limit.
        limit: u64,
        /// What the request needed.
        requested: u64,
    },
    /// A store operation that failed (`ADD` on a non-counter, …).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A query Ferry's server does not serve.
    #[error("c10d {0:?} is not supported by Ferry's store server")]
    Unsupported(QueryType),
}

/// What one query asks of the shell.
pub(crate) enum Step {
    /// Nothing to send.
    Quiet,
    /// Send this reply now.
    Reply(Reply),
    /// Send `STOP_WAITING` once this completes.
    Wait(BoxFuture<'static, ()>),
    /// Drop every pending wait and reply `WAIT_CANCELED`.
    CancelWaits,
}

/// One c10d connection's protocol state.
pub(crate) struct Session {
    served: Arc<Served>,
    conn: ConnId,
    validated: bool,
}

impl Session {
    pub(crate) fn new(served: Arc<Served>, conn: ConnId) -> Self {
        Session {
            served,
            conn,
            validated: false,
        }
    }

    /// Whether the client has validated.
    pub(crate) fn validated(&self) -> bool {
        self.validated
    }

    /// [`Served::write`] for this connection, its refusal as [`Refused`].
    fn write<T>(
        &self,
        key: &str,
        bytes: usize,
        store: impl FnOnce() -> (T, Option<usize>),
    ) -> Result<T, Refused> {
        self.served
            .write(self.conn, key, bytes, store)
            .map_err(|r| refused(key, r))
    }

    /// Handles `query`; `waiting` is the number of this connection's
    /// waits still pending.
    pub(crate) fn handle(&mut self, query: Query, waiting: usize) -> Result<Step, Refused> {
        if !self.validated {
            return match query {
                Query::Validate {
                    magic: VALIDATION_MAGIC,
                } => {
                    self.validated = true;
                    Ok(Step::Quiet)
                }
                Query::Validate { magic } => Err(C10dFormatError::BadMagic(magic).into()),
                other => Err(C10dFormatError::NotValidated(other.query_type()).into()),
            };
        }
        let state = &self.served.state;
        Ok(match query {
            Query::Validate {
                magic: VALIDATION_MAGIC,
            } => Step::Quiet,
            Query::Validate { magic } => return Err(C10dFormatError::BadMagic(magic).into()),
            Query::Set { key, value } => {
                let len = value.len();
                self.write(&key, len, || (state.insert(&key, value), Some(len)))?;
                Step::Quiet
            }
            Query::CompareSet {
                key,
                expected,
                desired,
            } => {
                let len = desired.len();
                // Only a swap that stores is charged (a key that already
                // held `desired` while `expected` differed stores nothing).
                let now = self.write(&key, len, || {
                    let (now, stored) = state.swap_if_c10d(&key, &expected, desired);
                    (now, stored.then_some(len))
                })?;
                Step::Reply(Reply::Value(now))
            }
            Query::Get { key } => Step::Reply(Reply::Value(state.value(&key).unwrap_or_default())),
            Query::Add { key, delta } => {
                let added = self
                    .served
                    .add(self.conn, &key, delta)
                    .map_err(|r| refused(&key, r))?;
                Step::Reply(Reply::Int(added?))
            }
            Query::Check { keys } => Step::Reply(Reply::Check(state.contains_all(&keys))),
            Query::Wait { keys } => {
                if let Err(r) = self.served.admit_wait(waiting) {
                    return Err(refused(keys.first().map_or("", String::as_str), r));
                }
                let state = state.clone();
                Step::Wait(
                    async move {
                        let _ = state.wait_for(&keys, UNBOUNDED_WAIT).await;
                    }
                    .boxed(),
                )
            }
            Query::NumKeys => Step::Reply(Reply::Int(state.len() as i64)),
            Query::DeleteKey { key } => {
                Step::Reply(Reply::Int(i64::from(self.served.delete(&key))))
            }
            Query::Append { key, value } => {
                let now = state.value(&key).map_or(0, |v| v.len());
                let len = now.saturating_add(value.len());
                self.write(&key, len, || (state.append(&key, &value), Some(len)))?;
                Step::Quiet
            }
            Query::MultiGet { keys } => Step::Reply(Reply::Values(
                keys.iter()
                    .map(|k| state.value(k).unwrap_or_default())
                    .collect(),
            )),
            Query::MultiSet { entries } => {
                for (key, value) in entries {
                    let len = value.len();
                    self.write(&key, len, || (state.insert(&key, value), Some(len)))?;
                }
                Step::Quiet
            }
            Query::CancelWait => Step::CancelWaits,
            Query::Ping { nonce } => Step::Reply(Reply::Nonce(nonce)),
            Query::ListKeys => Step::Reply(Reply::Keys(state.keys())),
            q @ (Query::QueuePush { .. } | Query::QueuePop { .. } | Query::QueueLen { .. }) => {
                return Err(Refused::Unsupported(q.query_type()))
            }
        })
    }
}

fn refused(key: &str, r: Refusal) -> Refused {
    Refused::Quota {
        bound: r.bound,
        key: key.to_owned(),
        limit: r.limit,
        requested: r.requested,
    }
}

/// Serves a c10d client on `rd` until it disconnects, breaks the
/// protocol, or the server closes; replies go to `tx` (written in order
/// by the caller's writer).
pub(crate) async fn serve_c10d<R: AsyncRead + Unpin>(
    mut session: Session,
    mut rd: R,
    tx: mpsc::UnboundedSender<Vec<u8>>,
    peer: std::net::SocketAddr,
    mut closed: watch::Receiver<bool>,
    validate_by: Instant,
) {
    let send = |reply: &Reply| match wire::encode_reply(reply) {
        Ok(bytes) => {
            let _ = tx.send(bytes);
        }
        Err(e) => warn!(%peer, error = %e, "cannot encode a c10d reply"),
    };
    let mut decoder = wire::QueryDecoder::default();
    let mut waits = FuturesUnordered::new();
    loop {
        // Every whole query in the buffer, in order.
        loop {
            let query = match decoder.next_query() {
                Ok(Some(q)) => q,
                Ok(None) => break,
                Err(e) => {
                    session
                        .served
                        .broken
                        .refused(peer, format_args!("c10d: {e}"));
                    return;
                }
            };
            match session.handle(query, waits.len()) {
                Ok(Step::Quiet) => {}
                Ok(Step::Reply(r)) => send(&r),
                Ok(Step::Wait(w)) => waits.push(w),
                Ok(Step::CancelWaits) => {
                    waits.clear();
                    send(&Reply::Wait(WaitReply::WaitCanceled));
                }
                Err(e) => {
                    session
                        .served
                        .broken
                        .refused(peer, format_args!("c10d: {e}"));
                    return;
                }
            }
        }
        tokio::select! {
            () = closing(&mut closed) => return,
            () = tokio::time::sleep_until(validate_by), if !session.validated() => {
                debug!(%peer, "closing a c10d store connection that did not validate in time");
                return;
            }
            Some(()) = waits.next(), if !waits.is_empty() => {
                send(&Reply::Wait(WaitReply::StopWaiting));
            }
            read = { let buf = decoder.buffer(); buf.reserve(16 << 10); rd.read_buf(buf) } => match read {
                Ok(0) => {
                    debug!(%peer, "c10d store client disconnected");
                    return;
                }
                Ok(_) => {}
                Err(e) => {
                    debug!(%peer, error = %e, "cannot read from c10d store client");
                    return;
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{MemoryStore, StoreLimits};

    fn session(limits: StoreLimits) -> Session {
        let served = Arc::new(Served::new(Arc::new(MemoryStore::default()), limits, None));
        Session::new(served, 1)
    }

    fn validated() -> Session {
        let mut s = session(StoreLimits::default());
        assert!(matches!(
            s.handle(
                Query::Validate {
                    magic: VALIDATION_MAGIC
                },
                0
            ),
            Ok(Step::Quiet)
        ));
        s
    }

    fn reply(s: &mut Session, q: Query) -> Reply {
        match s.handle(q, 0) {
            Ok(Step::Reply(r)) => r,
            Ok(_) => panic!("no reply"),
            Err(e) => panic!("refused: {e}"),
        }
    }

    #[test]
    fn nothing_is_served_before_validation() {
        let mut s = session(StoreLimits::default());
        let e = s.handle(Query::Ping { nonce: 1 }, 0).err().unwrap();
        assert_eq!(
            e.to_string(),
            "a c10d store client sent Ping before VALIDATE"
        );
        let e = s.handle(Query::Validate { magic: 7 }, 0).err().unwrap();
        assert_eq!(
            e.to_string(),
            "a c10d store client validated with magic 0x00000007, not 0x3c85f7ce"
        );
        assert!(!s.validated());
    }

    #[test]
    fn queries_act_on_the_shared_state() {
        let mut s = validated();
        assert!(matches!(
            s.handle(
                Query::Set {
                    key: "/a".into(),
                    value: b"1".to_vec()
                },
                0
            ),
            Ok(Step::Quiet)
        ));
        assert_eq!(
            reply(&mut s, Query::Get { key: "/a".into() }),
            Reply::Value(b"1".to_vec())
        );
        // A missing key reads as empty, as torch's libuv server answers.
        assert_eq!(
            reply(&mut s, Query::Get { key: "/b".into() }),
            Reply::Value(Vec::new())
        );
        assert_eq!(
            reply(
                &mut s,
                Query::Add {
                    key: "/n".into(),
                    delta: 2
                }
            ),
            Reply::Int(2)
        );
        assert_eq!(
            reply(
                &mut s,
                Query::Check {
                    keys: vec!["/a".into(), "/n".into()]
                }
            ),
            Reply::Check(true)
        );
        assert_eq!(reply(&mut s, Query::NumKeys), Reply::Int(2));
        assert_eq!(
            reply(&mut s, Query::ListKeys),
            Reply::Keys(vec!["/a".into(), "/n".into()])
        );
        assert_eq!(
            reply(&mut s, Query::DeleteKey { key: "/a".into() }),
            Reply::Int(1)
        );
        assert_eq!(
            reply(&mut s, Query::DeleteKey { key: "/a".into() }),
            Reply::Int(0)
        );
        assert_eq!(
            reply(
                &mut s,
                Query::MultiGet {
                    keys: vec!["/n".into(), "/a".into()]
                }
            ),
            Reply::Values(vec![b"2".to_vec(), Vec::new()])
        );
        assert!(matches!(
            s.handle(Query::QueueLen { key: "/q".into() }, 0),
            Err(Refused::Unsupported(QueryType::QueueLen))
        ));
    }

    #[tokio::test]
    async fn a_wait_completes_when_its_keys_are_set_and_cancels_on_request() {
        let mut s = validated();
        let Ok(Step::Wait(wait)) = s.handle(
            Query::Wait {
                keys: vec!["/k".into()],
            },
            0,
        ) else {
            panic!("a wait");
        };
        let waiting = tokio::spawn(wait);
        assert!(matches!(
            s.handle(
                Query::Set {
                    key: "/k".into(),
                    value: vec![]
                },
                1
            ),
            Ok(Step::Quiet)
        ));
        waiting.await.unwrap();
        assert!(matches!(
            s.handle(Query::CancelWait, 0),
            Ok(Step::CancelWaits)
        ));
        // The per-connection bound on pending waits holds.
        let limited = StoreLimits {
            max_waits_per_connection: 1,
            ..StoreLimits::default()
        };
        let mut s = session(limited);
        let _ = s.handle(
            Query::Validate {
                magic: VALIDATION_MAGIC,
            },
            0,
        );
        let e = s
            .handle(
                Query::Wait {
                    keys: vec!["/x".into()],
                },
                1,
            )
            .err()
            .unwrap();
        assert!(matches!(
            e,
            Refused::Quota {
                bound: QuotaBound::ConnectionWaits,
                ..
            }
        ));
    }

    /// A compare-set that did not store charges nothing: the key stays on
    /// the account of the connection that wrote it.
    #[test]
    fn only_writes_that_store_are_charged() {
        let served = Arc::new(Served::new(
            Arc::new(MemoryStore::default()),
            StoreLimits {
                max_keys_per_connection: 1,
                ..StoreLimits::default()
            },
            None,
        ));
        let open = |conn| {
            let mut s = Session::new(served.clone(), conn);
            let validate = Query::Validate {
                magic: VALIDATION_MAGIC,
            };
            assert!(matches!(s.handle(validate, 0), Ok(Step::Quiet)));
            s
        };
        let (mut a, mut b) = (open(1), open(2));
        let set = |key: &str| Query::Set {
            key: key.into(),
            value: b"v".to_vec(),
        };
        assert!(matches!(a.handle(set("/a"), 0), Ok(Step::Quiet)));
        let swap = Query::CompareSet {
            key: "/a".into(),
            expected: b"wrong".to_vec(),
            desired: b"x".to_vec(),
        };
        assert_eq!(reply(&mut b, swap), Reply::Value(b"v".to_vec()));
        assert!(matches!(b.handle(set("/b"), 0), Ok(Step::Quiet)));
        assert!(matches!(
            b.handle(set("/c"), 0),
            Err(Refused::Quota {
                bound: QuotaBound::ConnectionKeys,
                ..
            })
        ));
    }

    /// A counter is charged once, the same way whichever protocol adds to
    /// it (`Served::add`): admitted as the longest counter, charged as the
    /// text it holds ("5": key and one byte).
    #[test]
    fn a_c10d_add_is_charged_as_a_ferry_add() {
        const TOTAL: u64 = 100;
        let served = Arc::new(Served::new(
            Arc::new(MemoryStore::default()),
            StoreLimits {
                max_total_bytes: TOTAL,
                ..StoreLimits::default()
            },
            None,
        ));
        let mut s = Session::new(served.clone(), 1);
        let validate = Query::Validate {
            magic: VALIDATION_MAGIC,
        };
        assert!(matches!(s.handle(validate, 0), Ok(Step::Quiet)));
        let add = Query::Add {
            key: "/n".into(),
            delta: 5,
        };
        assert_eq!(reply(&mut s, add), Reply::Int(5));
        // "/n" holds 3 bytes of the total: what is left fits exactly.
        let left = usize::try_from(TOTAL - 3).unwrap() - "/m".len();
        let ledger = served.ledger.lock();
        assert!(ledger.admit(&served.limits, 2, "/m", left).is_ok());
        assert_eq!(
            ledger
                .admit(&served.limits, 2, "/m", left + 1)
                .unwrap_err()
                .bound,
            QuotaBound::TotalBytes
        );
        drop(ledger);
        assert_eq!(served.add(2, "/n", 10).unwrap().unwrap(), 15);
    }
}
