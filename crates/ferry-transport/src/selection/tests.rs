use ferry_wire::{ChannelChoice, ChannelOffer, Device, DeviceOffer};

use super::*;

const HOST: &str = "boot-A/ns-1";

fn offer(name: &str, priority: i32, devices: &[(Device, &str)]) -> ChannelOffer {
    ChannelOffer {
        name: name.to_owned(),
        priority,
        devices: devices
            .iter()
            .map(|&(device, descriptor)| DeviceOffer {
                device,
                descriptor: descriptor.to_owned(),
            })
            .collect(),
    }
}

fn cpu(name: &str, priority: i32, descriptor: &str) -> ChannelOffer {
    offer(name, priority, &[(Device::Cpu, descriptor)])
}

/// A same-host worker's offers: cma > shm > mpt > inline.
fn host_offers(host: &str) -> Vec<ChannelOffer> {
    vec![
        cpu("inline", 0, "any"),
        cpu("mpt", 10, "tcp"),
        cpu("cma", 30, host),
        cpu("shm", 20, host),
    ]
}

fn choice(source: Device, target: Device, channel: &str) -> ChannelChoice {
    ChannelChoice {
        source,
        target,
        channel: channel.to_owned(),
    }
}

fn cpu_channel(sender: &[ChannelOffer], receiver: &[ChannelOffer]) -> String {
    let s = Selection::compute(sender, receiver).expect("valid offers");
    s.channel_for(Device::Cpu, Device::Cpu)
        .expect("a channel")
        .to_owned()
}

#[test]
fn highest_common_channel_wins() {
    assert_eq!(cpu_channel(&host_offers(HOST), &host_offers(HOST)), "cma");
    assert_eq!(
        select_channels(&host_offers(HOST), &host_offers(HOST)).expect("valid"),
        vec![choice(Device::Cpu, Device::Cpu, "cma")]
    );
}

#[test]
fn descriptor_mismatch_falls_back() {
    // cma needs the same namespace; shm only the same boot id.
    let sender = [
        cpu("cma", 30, "boot-A/ns-1"),
        cpu("shm", 20, "boot-A"),
        cpu("inline", 0, "any"),
    ];
    let receiver = [
        cpu("cma", 30, "boot-A/ns-2"),
        cpu("shm", 20, "boot-A"),
        cpu("inline", 0, "any"),
    ];
    assert_eq!(cpu_channel(&sender, &receiver), "shm");
    // Different hosts: only the host-independent channels remain.
    assert_eq!(
        cpu_channel(&host_offers("boot-A"), &host_offers("boot-B")),
        "mpt"
    );
}

#[test]
fn channel_offered_by_one_side_is_skipped() {
    let receiver = [cpu("shm", 20, HOST), cpu("inline", 0, "any")];
    assert_eq!(cpu_channel(&host_offers(HOST), &receiver), "shm");
    assert_eq!(cpu_channel(&receiver, &host_offers(HOST)), "shm");
}

#[test]
fn device_pairs_choose_independently() {
    let gpu_host = || {
        vec![
            offer("cuda_ipc", 50, &[(Device::Cuda(0), "boot-A/gpu-bus-1")]),
            offer(
                "cuda_staged",
                5,
                &[(Device::Cuda(0), "any"), (Device::Cuda(1), "any")],
            ),
            cpu("shm", 20, "boot-A"),
            cpu("inline", 0, "any"),
        ]
    };
    let sel = Selection::compute(&gpu_host(), &gpu_host()).expect("valid");
    assert_eq!(
        sel.channel_for(Device::Cuda(0), Device::Cuda(0))
            .expect("a channel"),
        "cuda_ipc"
    );
    assert_eq!(
        sel.channel_for(Device::Cpu, Device::Cpu)
            .expect("a channel"),
        "shm"
    );
    assert_eq!(
        sel.channel_for(Device::Cuda(0), Device::Cuda(1))
            .expect("a channel"),
        "cuda_staged"
    );
    assert_eq!(
        sel.channel_for(Device::Cuda(1), Device::Cuda(0))
            .expect("a channel"),
        "cuda_staged"
    );
    // No channel links host memory and a GPU here.
    assert_eq!(
        sel.channel_for(Device::Cpu, Device::Cuda(0)),
        Err(SelectionError::NoChannel {
            source: Device::Cpu,
            target: Device::Cuda(0)
        })
    );
    // Sorted by (source, target).
    let pairs: Vec<_> = sel.choices().iter().map(|c| (c.source, c.target)).collect();
    let mut sorted = pairs.clone();
    sorted.sort();
    assert_eq!(pairs, sorted);
    assert_eq!(pairs.len(), 5);
}

#[test]
fn differing_priorities_use_the_sum_in_both_roles() {
    // A prefers shm, B prefers mpt; sums: shm 20+5 = 25, mpt 1+30 = 31.
    let a = [cpu("shm", 20, HOST), cpu("mpt", 1, "tcp")];
    let b = [cpu("shm", 5, HOST), cpu("mpt", 30, "tcp")];
    assert_eq!(cpu_channel(&a, &b), "mpt");
    assert_eq!(cpu_channel(&b, &a), "mpt");

    // Asymmetric devices: A sends from cuda:0 into B's cpu and back.
    let a = [
        offer("staged", 1, &[(Device::Cuda(0), "x")]),
        offer("direct", 9, &[(Device::Cuda(0), "x")]),
    ];
    let b = [
        offer("staged", 10, &[(Device::Cpu, "x")]),
        offer("direct", 0, &[(Device::Cpu, "x")]),
    ];
    let ab = select_channels(&a, &b).expect("valid");
    let ba = select_channels(&b, &a).expect("valid");
    assert_eq!(ab, vec![choice(Device::Cuda(0), Device::Cpu, "staged")]);
    assert_eq!(ba, vec![choice(Device::Cpu, Device::Cuda(0), "staged")]);
}

#[test]
fn ties_break_by_name() {
    let a = [
        cpu("zeta", 10, "d"),
        cpu("alpha", 5, "d"),
        cpu("mu", 10, "d"),
    ];
    let b = [cpu("mu", 0, "d"), cpu("zeta", 0, "d"), cpu("alpha", 5, "d")];
    // All sums are 10: the smallest name wins, whatever the list order.
    assert_eq!(cpu_channel(&a, &b), "alpha");
    assert_eq!(cpu_channel(&b, &a), "alpha");
}

#[test]
fn priority_sum_does_not_overflow() {
    let a = [cpu("big", i32::MAX, "d"), cpu("small", i32::MAX - 1, "d")];
    assert_eq!(cpu_channel(&a, &a), "big");
    let low = [cpu("neg", i32::MIN, "d"), cpu("zero", 0, "d")];
    assert_eq!(cpu_channel(&low, &low), "zero");
}

#[test]
fn empty_offers_give_empty_selection() {
    for (s, r) in [
        (Vec::new(), Vec::new()),
        (host_offers(HOST), Vec::new()),
        (Vec::new(), host_offers(HOST)),
    ] {
        let sel = Selection::compute(&s, &r).expect("valid");
        assert!(sel.choices().is_empty());
        let err = sel
            .channel_for(Device::Cpu, Device::Cpu)
            .expect_err("no channel");
        assert_eq!(
            err,
            SelectionError::NoChannel {
                source: Device::Cpu,
                target: Device::Cpu
            }
        );
        assert!(err.to_string().contains("from cpu"), "{err}");
    }
    assert!(Selection::default()
        .channel_for(Device::Cuda(3), Device::Cpu)
        .expect_err("no channel")
        .to_string()
        .contains("from cuda:3 on the sender to cpu on the receiver"));
}

#[test]
fn duplicate_names_are_rejected() {
    let dup = [
        cpu("shm", 20, HOST),
        cpu("inline", 0, "any"),
        cpu("shm", 1, HOST),
    ];
    let want = SelectionError::DuplicateChannel { name: "shm".into() };
    assert_eq!(select_channels(&dup, &host_offers(HOST)), Err(want.clone()));
    assert_eq!(select_channels(&host_offers(HOST), &dup), Err(want.clone()));
    assert!(want.to_string().contains("\"shm\""));

    let dup_dev = [offer("shm", 1, &[(Device::Cpu, "a"), (Device::Cpu, "b")])];
    let err = select_channels(&dup_dev, &[]).expect_err("duplicate device");
    assert_eq!(
        err,
        SelectionError::DuplicateDevice {
            channel: "shm".into(),
            device: Device::Cpu
        }
    );
}

#[test]
fn verify_accepts_equal_lists() {
    let sel = select_channels(&host_offers(HOST), &host_offers(HOST)).expect("valid");
    assert_eq!(verify(&sel, &sel), Ok(()));
    assert_eq!(verify(&[], &[]), Ok(()));
    let two = vec![
        choice(Device::Cpu, Device::Cpu, "shm"),
        choice(Device::Cuda(0), Device::Cuda(0), "cuda_ipc"),
    ];
    let reversed: Vec<_> = two.iter().rev().cloned().collect();
    assert_eq!(verify(&two, &reversed), Ok(()));
    assert_eq!(Selection::new(reversed).verify(&two), Ok(()));
}

#[test]
fn verify_names_the_first_difference() {
    let local = vec![
        choice(Device::Cpu, Device::Cpu, "shm"),
        choice(Device::Cpu, Device::Cuda(0), "staged"),
        choice(Device::Cuda(0), Device::Cuda(0), "cuda_ipc"),
    ];
    let mut remote = local.clone();
    remote[1].channel = "inline".into();
    remote[2].channel = "inline".into();
    let err = verify(&local, &remote).expect_err("mismatch");
    assert_eq!(
        err,
        SelectionError::Mismatch {
            source: Device::Cpu,
            target: Device::Cuda(0),
            local: Some("staged".into()),
            remote: Some("inline".into()),
        }
    );
    let msg = err.to_string();
    assert!(msg.contains("cpu -> cuda:0"), "{msg}");
    assert!(
        msg.contains("\"staged\"") && msg.contains("\"inline\""),
        "{msg}"
    );

    // A pair only one side has.
    let err = verify(&local, &local[..2]).expect_err("mismatch");
    assert_eq!(
        err,
        SelectionError::Mismatch {
            source: Device::Cuda(0),
            target: Device::Cuda(0),
            local: Some("cuda_ipc".into()),
            remote: None,
        }
    );
    assert!(err.to_string().contains("the peer chose no channel"));
    let err = verify(&local[1..], &local).expect_err("mismatch");
    assert_eq!(
        err,
        SelectionError::Mismatch {
            source: Device::Cpu,
            target: Device::Cpu,
            local: None,
            remote: Some("shm".into()),
        }
    );

    // A pair named twice.
    let dup = vec![local[0].clone(), local[0].clone()];
    assert_eq!(
        verify(&local, &dup),
        Err(SelectionError::DuplicatePair {
            source: Device::Cpu,
            target: Device::Cpu
        })
    );
}

#[test]
fn errors_are_leaf_errors_with_clear_messages() {
    use std::error::Error as _;
    let errors = [
        SelectionError::DuplicateChannel { name: "shm".into() },
        SelectionError::DuplicateDevice {
            channel: "shm".into(),
            device: Device::Cuda(2),
        },
        SelectionError::NoChannel {
            source: Device::Cuda(1),
            target: Device::Cpu,
        },
        SelectionError::Mismatch {
            source: Device::Cpu,
            target: Device::Cuda(0),
            local: None,
            remote: Some("cuda_ipc".into()),
        },
        SelectionError::DuplicatePair {
            source: Device::Cuda(1),
            target: Device::Cuda(0),
        },
    ];
    let messages: Vec<String> = errors.iter().map(ToString::to_string).collect();
    for e in &errors {
        // A device field is not the error's cause.
        assert!(e.source().is_none(), "{e}");
    }
    assert!(messages[1].contains("\"shm\"") && messages[1].contains("cuda:2"));
    assert!(messages[2].contains("from cuda:1 on the sender to cpu on the receiver"));
    assert!(messages[3].contains("cpu -> cuda:0"), "{}", messages[3]);
    assert!(messages[3].contains("this worker chose no channel"));
    assert!(messages[3].contains("the peer chose channel \"cuda_ipc\""));
    assert!(messages[4].contains("cuda:1 -> cuda:0"));
}

#[test]
fn new_sorts_and_keeps_first_duplicate() {
    let sel = Selection::new(vec![
        choice(Device::Cuda(1), Device::Cpu, "b"),
        choice(Device::Cpu, Device::Cpu, "a"),
        choice(Device::Cuda(1), Device::Cpu, "c"),
    ]);
    assert_eq!(
        sel.into_choices(),
        vec![
            choice(Device::Cpu, Device::Cpu, "a"),
            choice(Device::Cuda(1), Device::Cpu, "b"),
        ]
    );
}

mod properties {
    use super::*;
    use proptest::prelude::*;

    const NAMES: [&str; 5] = ["cma", "cuda_ipc", "inline", "mpt", "shm"];
    const DEVICES: [Device; 3] = [Device::Cpu, Device::Cuda(0), Device::Cuda(1)];

    fn device_offers() -> impl Strategy<Value = Vec<DeviceOffer>> {
        prop::sample::subsequence(DEVICES.to_vec(), 0..=DEVICES.len()).prop_flat_map(|devices| {
            let n = devices.len();
            (
                Just(devices),
                prop::collection::vec(prop::sample::select(vec!["x", "y"]), n),
            )
                .prop_map(|(devices, descriptors)| {
                    devices
                        .into_iter()
                        .zip(descriptors)
                        .map(|(device, d)| DeviceOffer {
                            device,
                            descriptor: d.to_owned(),
                        })
                        .collect()
                })
        })
    }

    /// Offers with distinct names, small priorities (many ties) and
    /// few descriptors (many matches), in random order.
    fn offers() -> impl Strategy<Value = Vec<ChannelOffer>> {
        prop::sample::subsequence(NAMES.to_vec(), 0..=NAMES.len())
            .prop_flat_map(|names| {
                let n = names.len();
                (
                    Just(names),
                    prop::collection::vec((-2i32..=2, device_offers()), n),
                )
            })
            .prop_map(|(names, rest)| {
                names
                    .into_iter()
                    .zip(rest)
                    .map(|(name, (priority, devices))| ChannelOffer {
                        name: name.to_owned(),
                        priority,
                        devices,
                    })
                    .collect::<Vec<_>>()
            })
            .prop_shuffle()
    }

    /// The rank of `name` for (`source`, `target`) if it qualifies.
    fn qualifies(
        sender: &[ChannelOffer],
        receiver: &[ChannelOffer],
        name: &str,
        source: Device,
        target: Device,
    ) -> Option<i64> {
        let s = sender.iter().find(|o| o.name == name)?;
        let r = receiver.iter().find(|o| o.name == name)?;
        let sd = s.devices.iter().find(|d| d.device == source)?;
        let rd = r.devices.iter().find(|d| d.device == target)?;
        (sd.descriptor == rd.descriptor).then(|| i64::from(s.priority) + i64::from(r.priority))
    }

    fn transpose(choices: &[ChannelChoice]) -> Vec<ChannelChoice> {
        let mut t: Vec<_> = choices
            .iter()
            .map(|c| choice(c.target, c.source, &c.channel))
            .collect();
        t.sort_by_key(|c| (c.source, c.target));
        t
    }

    proptest! {
        #[test]
        fn selection_follows_the_rule(sender in offers(), receiver in offers()) {
            let got = select_channels(&sender, &receiver).expect("valid offers");

            // Deterministic, and independent of the order of the lists.
            prop_assert_eq!(&got, &select_channels(&sender, &receiver).expect("valid"));
            let (mut s_rev, mut r_rev) = (sender.clone(), receiver.clone());
            s_rev.reverse();
            r_rev.reverse();
            prop_assert_eq!(&got, &select_channels(&s_rev, &r_rev).expect("valid"));

            // Swapping the roles transposes the pairs.
            let swapped = select_channels(&receiver, &sender).expect("valid");
            prop_assert_eq!(transpose(&got), swapped);

            // Sorted, one entry per pair.
            for w in got.windows(2) {
                prop_assert!((w[0].source, w[0].target) < (w[1].source, w[1].target));
            }
            prop_assert_eq!(verify(&got, &got), Ok(()));

            let sel = Selection::new(got.clone());
            for source in DEVICES {
                for target in DEVICES {
                    let best = NAMES
                        .iter()
                        .filter_map(|&n| {
                            qualifies(&sender, &receiver, n, source, target).map(|r| (r, n))
                        })
                        // Highest sum, then smallest name; written out
                        // here independently of `outranks`.
                        .max_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(a.1)));
                    match (best, sel.channel_for(source, target)) {
                        (None, Err(e)) => prop_assert_eq!(
                            e,
                            SelectionError::NoChannel { source, target }
                        ),
                        (Some((rank, name)), Ok(chosen)) => {
                            // Offered by both sides, right devices, equal descriptors.
                            let chosen_rank =
                                qualifies(&sender, &receiver, chosen, source, target);
                            prop_assert_eq!(chosen_rank, Some(rank));
                            // No better-ranked qualifying channel exists.
                            for &other in &NAMES {
                                if let Some(r) =
                                    qualifies(&sender, &receiver, other, source, target)
                                {
                                    prop_assert!(
                                        r < rank || (r == rank && other >= chosen),
                                        "{} ranks above {}", other, chosen
                                    );
                                }
                            }
                            prop_assert_eq!(chosen, name);
                        }
                        (want, got) => prop_assert!(
                            false,
                            "pair {} -> {}: want {:?}, got {:?}",
                            source,
                            target,
                            want,
                            got
                        ),
                    }
                }
            }
        }

        #[test]
        fn disclosure_hides_foreign_descriptors_and_keeps_the_selection(
            local in offers(),
            peer in offers(),
        ) {
            let shown = disclosed_channels(&local, &peer);
            // Every descriptor shown is one the peer gave for that channel.
            for o in &shown {
                for d in &o.devices {
                    prop_assert!(peer.iter().any(|p| p.name == o.name
                        && p.devices.iter().any(|pd| pd.descriptor == d.descriptor)));
                }
            }
            // Both ends still compute the same selection, both ways.
            prop_assert_eq!(
                select_channels(&shown, &peer).expect("valid"),
                select_channels(&local, &peer).expect("valid")
            );
            prop_assert_eq!(
                select_channels(&peer, &shown).expect("valid"),
                select_channels(&peer, &local).expect("valid")
            );
        }

        #[test]
        fn verify_detects_any_single_change(
            sender in offers(),
            receiver in offers(),
            pick in any::<prop::sample::Index>(),
        ) {
            let local = select_channels(&sender, &receiver).expect("valid");
            if local.is_empty() {
                // Nothing chosen here: a peer that chose anything differs.
                let remote = [choice(Device::Cuda(1), Device::Cpu, "inline")];
                prop_assert_eq!(
                    verify(&local, &remote),
                    Err(SelectionError::Mismatch {
                        source: Device::Cuda(1),
                        target: Device::Cpu,
                        local: None,
                        remote: Some("inline".into()),
                    })
                );
                return Ok(());
            }
            let i = pick.index(local.len());
            let mut remote = local.clone();
            remote[i].channel.push('!');
            prop_assert_eq!(
                verify(&local, &remote),
                Err(SelectionError::Mismatch {
                    source: local[i].source,
                    target: local[i].target,
                    local: Some(local[i].channel.clone()),
                    remote: Some(remote[i].channel.clone()),
                })
            );
            // A pair the peer left out.
            remote.remove(i);
            prop_assert_eq!(
                verify(&local, &remote),
                Err(SelectionError::Mismatch {
                    source: local[i].source,
                    target: local[i].target,
                    local: Some(local[i].channel.clone()),
                    remote: None,
                })
            );
        }
    }
}
