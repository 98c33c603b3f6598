//! A set-up's outcome turned into a [`PeerConnection`]: the frame reader
//! and writer over the TCP stream's records (continuing where the set-up
//! left them), moved onto the `shm` rings or UCX when that transport was
//! selected, with the channels the set-up produced.

use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use super::machine::{Agreement, Outcome};
use super::setup::Setup;
use super::{Connection, Endpoint, PeerConnection, PeerReader, PeerWriter, UcxLink};
use crate::auth::{RecordReader, RecordWriter, SessionKey};
use crate::framing::{ReadChannels, Shared, WriteChannels};
use crate::mpt::{MptReceiver, MptSender};
use crate::selection::Selection;
use crate::{channel, FrameReader, FrameWriter, TransportError};
use ferry_wire::PeerText;

impl PeerConnection {
    /// The connection from a set-up's `outcome`, the `setup` it ran and
    /// the UCX `link` its check made, over `stream`.
    pub(super) fn assemble(
        stream: TcpStream,
        local: &Endpoint,
        outcome: Outcome,
        setup: Setup,
        link: Option<UcxLink>,
        peer_addr: &str,
    ) -> Result<Self, TransportError> {
        let io_err = |source| TransportError::Io {
            peer: peer_addr.to_owned(),
            source,
        };
        let fail = |reason: String| TransportError::Handshake {
            peer: peer_addr.to_owned(),
            reason,
        };
        let Outcome {
            agreement,
            session,
            opener,
            sealer,
            plain,
            sealed,
            ucx_fallback,
        } = outcome;
        let (r, w) = stream.into_split();
        let mut reader = FrameReader::new(
            PeerReader::Tcp(RecordReader::with_buffered(r, opener, &plain, &sealed)),
            ferry_wire::handshake_limits(),
            local.allocator.clone(),
            Selection::default(),
            peer_addr,
        );
        let mut writer = FrameWriter::new(
            PeerWriter::Tcp(RecordWriter::new(w, sealer)),
            Selection::default(),
            peer_addr,
        );
        writer.set_flush(session.is_some());
        // Tensor bytes that cross outside the records (`ucx`) carry a MAC.
        let tensor_keys = session.as_ref().map(SessionKey::tensor_keys);
        writer.set_tensor_mac(tensor_keys.map(|k| k.0));
        reader.set_tensor_mac(tensor_keys.map(|k| k.1));
        // The link of a check whose selection then fell back is dropped.
        let ucx = link.filter(|_| agreement.needs_ucx());
        // The `mpt` lanes are TCP connections too: a partition mid-transfer
        // ends them within the same bounds.
        if let Some((incoming_lanes, outgoing_lanes)) = &setup.lanes {
            for lane in incoming_lanes.iter().chain(outgoing_lanes) {
                local.keepalive.apply(lane.socket()).map_err(&io_err)?;
            }
        }
        if agreement.needs_ucx() != ucx.is_some() {
            return Err(fail("ucx is selected but this side has no UCX link".into()));
        }
        let Agreement {
            peer,
            outgoing,
            incoming,
            transport,
        } = agreement;
        // The name the peer states, as errors and logs show it (escaped
        // and bounded: the agent has not yet checked it against its group).
        let name = PeerText::new(&peer.worker_name).to_string();
        // Only the process the kernel vouches for, never a pid a peer states.
        let peer_pid = setup.peer_pid;
        let uses_cma_in = incoming.iter().any(|c| c.channel == channel::CMA);
        let uses_cma_out = outgoing.iter().any(|c| c.channel == channel::CMA);
        if (uses_cma_in || uses_cma_out) && (peer_pid.is_none() || setup.frames.is_none()) {
            return Err(fail(
                "cma is selected without the shm transport's verified peer process".into(),
            ));
        }
        let gone = setup.peer_gone;
        let (frames, data) = (setup.frames, setup.data);
        let (data_reader, data_writer) = match data {
            Some(link) => {
                let (mut r, mut w) = link.split(gone.clone().map(|g| g.future()));
                r.set_spin(local.config.spin);
                w.set_spin(local.config.spin);
                (
                    Some(Box::new(r) as Box<dyn AsyncRead + Send + Unpin>),
                    Some(Box::new(w) as Box<dyn AsyncWrite + Send + Unpin>),
                )
            }
            None => (None, None),
        };
        let (mpt_in, mpt_out) = match setup.lanes {
            Some((incoming_lanes, outgoing_lanes)) => (
                Some(MptReceiver::new(incoming_lanes, name.clone())),
                Some(MptSender::new(outgoing_lanes, name.clone())),
            ),
            None => (None, None),
        };
        let shared = Arc::new(Shared::default());
        if let Some(link) = frames {
            // From here on frames travel through the rings. Nothing may be
            // buffered from the TCP stream: both ends send nothing on it
            // after the handshake when the shm transport is selected.
            let (mut sr, mut sw) = link.split(gone.map(|g| g.future()));
            sr.set_spin(local.config.spin);
            sw.set_spin(local.config.spin);
            reader = reader
                .map_stream(|r| match r {
                    PeerReader::Tcp(tcp) | PeerReader::Shm(_, tcp) => PeerReader::Shm(sr, tcp),
                    #[cfg(feature = "ucx")]
                    PeerReader::Ucx(_) => r,
                })
                .map_err(|n| fail(format!("{n} bytes arrived on TCP after the handshake")))?;
            writer = writer.map_stream(|w| match w {
                PeerWriter::Tcp(tcp) | PeerWriter::Shm(_, tcp) => PeerWriter::Shm(sw, tcp),
                #[cfg(feature = "ucx")]
                PeerWriter::Ucx(_) => w,
            });
        }
        #[cfg(feature = "ucx")]
        if let (channel::UCX_TRANSPORT, Some(link)) = (transport, &ucx) {
            // From here on frames travel as UCX tag messages; the TCP
            // connection stays open beside them (the reader watches it).
            // With a secret they stay in sealed records, each direction's
            // count going on from the TCP stream's.
            reader = reader
                .map_stream(|r| match r {
                    PeerReader::Tcp(tcp) => {
                        let (tcp, opener) = tcp.into_parts();
                        PeerReader::Ucx(RecordReader::new(
                            crate::ucx::UcxReader::new(link.clone(), tcp),
                            opener,
                        ))
                    }
                    other => other,
                })
                .map_err(|n| fail(format!("{n} bytes arrived on TCP after the handshake")))?;
            writer = writer.map_stream(|w| match w {
                PeerWriter::Tcp(tcp) => {
                    let (tcp, sealer) = tcp.into_parts();
                    PeerWriter::Ucx(RecordWriter::new(
                        crate::ucx::UcxWriter::new(link.clone(), tcp),
                        sealer,
                    ))
                }
                other => other,
            });
        }
        #[cfg(feature = "ucx")]
        let uses_ucx_in = incoming.iter().any(|c| c.channel == channel::UCX);
        #[cfg(feature = "ucx")]
        let uses_ucx_out = outgoing.iter().any(|c| c.channel == channel::UCX);
        #[cfg(not(feature = "ucx"))]
        let _ = ucx;
        reader.set_limits(local.limits);
        reader.set_selection(Selection::new(incoming));
        reader.set_peer(name.clone());
        writer.set_selection(Selection::new(outgoing));
        writer.set_peer(name.clone());
        writer.set_peer_limits(peer.limits);
        reader.set_channels(
            ReadChannels {
                cma_pid: if uses_cma_in { peer_pid } else { None },
                shm: data_reader,
                mpt: mpt_in,
                #[cfg(feature = "ucx")]
                ucx: ucx.clone().filter(|_| uses_ucx_in),
                cma_threads: local.config.cma_threads,
                cuda: crate::framing::CudaSide::new(&local.config),
            },
            shared.clone(),
        );
        writer.set_channels(
            WriteChannels {
                cma: uses_cma_out,
                shm: data_writer,
                mpt: mpt_out,
                #[cfg(feature = "ucx")]
                ucx: ucx.filter(|_| uses_ucx_out),
                small_tensor_bytes: local.config.small_tensor_bytes,
                cuda: crate::framing::CudaSide::new(&local.config),
            },
            shared,
        );
        Ok(Connection {
            peer,
            transport,
            reader,
            writer,
            ucx_fallback,
        })
    }
}
