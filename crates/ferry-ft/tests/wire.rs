//! The generated wire types keep torchft's field numbers, and the tonic
//! services and clients exist.

use ferry_ft::proto::{
    lighthouse_service_client::LighthouseServiceClient, lighthouse_service_server,
    manager_service_client::ManagerServiceClient, manager_service_server, ManagerQuorumRequest,
    ManagerQuorumResponse, Quorum, QuorumMember, ShouldCommitRequest,
};
use prost::Message;

/// Encodes a message and returns its bytes.
fn bytes(m: &impl Message) -> Vec<u8> {
    m.encode_to_vec()
}

/// The tag byte of field `number` with wire type `wire` (numbers < 16).
fn tag(number: u8, wire: u8) -> u8 {
    (number << 3) | wire
}

#[test]
fn quorum_member_field_numbers() {
    let m = QuorumMember {
        data: "d".into(),
        ..Default::default()
    };
    assert_eq!(bytes(&m), [tag(7, 2), 1, b'd']);
    let m = QuorumMember {
        commit_failures: 5,
        ..Default::default()
    };
    assert_eq!(bytes(&m), [tag(8, 0), 5]);
    let m = QuorumMember {
        world_size: 3,
        shrink_only: true,
        step: 9,
        ..Default::default()
    };
    assert_eq!(bytes(&m), [tag(4, 0), 9, tag(5, 0), 3, tag(6, 0), 1]);
}

#[test]
fn manager_messages_field_numbers() {
    let r = ManagerQuorumRequest {
        group_rank: 1,
        init_sync: true,
        commit_failures: 2,
        ..Default::default()
    };
    assert_eq!(bytes(&r), [tag(1, 0), 1, tag(5, 0), 1, tag(6, 0), 2]);

    let r = ManagerQuorumResponse {
        recover_src_replica_rank: Some(0),
        heal: true,
        commit_failures: 4,
        replica_ids: vec!["a".into()],
        ..Default::default()
    };
    // An explicit optional zero is still sent (field 3).
    assert_eq!(
        bytes(&r),
        [
            tag(3, 0),
            0,
            tag(11, 0),
            1,
            tag(12, 0),
            4,
            tag(13, 2),
            1,
            b'a'
        ]
    );

    let s = ShouldCommitRequest {
        should_commit: true,
        group_rank: 2,
        step: 3,
    };
    assert_eq!(bytes(&s), [tag(1, 0), 1, tag(2, 0), 2, tag(3, 0), 3]);
}

#[test]
fn quorum_round_trips() {
    let q = Quorum {
        quorum_id: 42,
        participants: vec![QuorumMember {
            replica_id: "r".into(),
            step: 7,
            ..Default::default()
        }],
        created: Some(prost_types::Timestamp {
            seconds: 1,
            nanos: 2,
        }),
    };
    let back = Quorum::decode(bytes(&q).as_slice()).expect("decodes");
    assert_eq!(back, q);
    // Garbage never panics.
    assert!(Quorum::decode(&[0xff, 0xff, 0xff][..]).is_err());
}

/// The gRPC paths are torchft's.
#[test]
fn service_names() {
    assert_eq!(
        <lighthouse_service_server::LighthouseServiceServer<NoLighthouse> as tonic::server::NamedService>::NAME,
        "torchft.LighthouseService"
    );
    assert_eq!(
        <manager_service_server::ManagerServiceServer<NoManager> as tonic::server::NamedService>::NAME,
        "torchft.ManagerService"
    );
    // The clients are there for the transport.
    let _ = std::mem::size_of::<LighthouseServiceClient<tonic::transport::Channel>>();
    let _ = std::mem::size_of::<ManagerServiceClient<tonic::transport::Channel>>();
}

struct NoLighthouse;

#[tonic::async_trait]
impl lighthouse_service_server::LighthouseService for NoLighthouse {
    async fn quorum(
        &self,
        _: tonic::Request<ferry_ft::proto::LighthouseQuorumRequest>,
    ) -> Result<tonic::Response<ferry_ft::proto::LighthouseQuorumResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("test"))
    }

    async fn heartbeat(
        &self,
        _: tonic::Request<ferry_ft::proto::LighthouseHeartbeatRequest>,
    ) -> Result<tonic::Response<ferry_ft::proto::LighthouseHeartbeatResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("test"))
    }
}

struct NoManager;

#[tonic::async_trait]
impl manager_service_server::ManagerService for NoManager {
    async fn quorum(
        &self,
        _: tonic::Request<ManagerQuorumRequest>,
    ) -> Result<tonic::Response<ManagerQuorumResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("test"))
    }

    async fn checkpoint_metadata(
        &self,
        _: tonic::Request<ferry_ft::proto::CheckpointMetadataRequest>,
    ) -> Result<tonic::Response<ferry_ft::proto::CheckpointMetadataResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("test"))
    }

    async fn should_commit(
        &self,
        _: tonic::Request<ShouldCommitRequest>,
    ) -> Result<tonic::Response<ferry_ft::proto::ShouldCommitResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("test"))
    }

    async fn kill(
        &self,
        _: tonic::Request<ferry_ft::proto::KillRequest>,
    ) -> Result<tonic::Response<ferry_ft::proto::KillResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("test"))
    }
}
