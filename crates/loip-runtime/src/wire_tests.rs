//! Unit tests of the wire codecs (kept beside `wire.rs`).
use super::step::FLAG_ARGMAX;
use super::*;
use loip_engine::TokenPos;

#[test]
fn random_bytes_never_panic_a_decoder() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let valid = encode_step(
        &StepHeader {
            step: 1,
            embed: true,
            head: true,
            keep: false,
            stages: vec![0],
            batch: vec![TokenPos { seq: 1, pos: 0 }],
            rows: vec![0],
            argmax: Some(vec![2]),
            row_masks: vec![vec![3]],
            rewind: vec![1],
        },
        &[0; 4],
    );
    for i in 0..20_000 {
        let mut b: Vec<u8> = if i % 2 == 0 {
            (0..rng.gen_range(0..96)).map(|_| rng.gen()).collect()
        } else {
            let mut v = valid.clone();
            let j = rng.gen_range(0..v.len());
            v[j] = rng.gen();
            v
        };
        let _ = decode_step(&b);
        let _ = decode_output(&b);
        let _ = bytes_f32(&b);
        for kind in [FrameKind::Control, FrameKind::Hello, FrameKind::Error] {
            let f = Frame {
                kind,
                payload: b.clone(),
            };
            let _ = parse_control::<ToWorker>(&f);
            let _ = parse_control::<ToCoordinator>(&f);
            let _ = check_hello(&f);
        }
        b.truncate(b.len() / 2);
        let _ = decode_step(&b);
    }
}

#[test]
fn step_round_trips_and_rejects_truncation() {
    let h = StepHeader {
        step: 7,
        embed: false,
        head: true,
        keep: true,
        stages: vec![0, 2],
        batch: vec![TokenPos { seq: 3, pos: 9 }, TokenPos { seq: 3, pos: 10 }],
        rows: vec![1],
        argmax: None,
        row_masks: vec![],
        rewind: vec![],
    };
    let data = f32_bytes(&[1.5, -0.0, f32::MIN_POSITIVE, 3.0]);
    let p = encode_step(&h, &data);
    let (h2, d2) = decode_step(&p).unwrap();
    assert_eq!(h2, h);
    assert_eq!(d2, &data[..]);
    for cut in 0..p.len() - data.len() {
        assert!(decode_step(&p[..cut]).is_err(), "cut at {cut}");
    }
    let out = OutputHeader {
        step: 7,
        kind: OutputKind::Logits,
        rows: 1,
        cols: 4,
        times: JobTimes::default(),
    };
    let p = encode_output(&out, &data);
    let (o2, d) = decode_output(&p).unwrap();
    assert_eq!(o2, out);
    assert_eq!(
        bytes_f32(d)
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect::<Vec<_>>(),
        [1.5f32, -0.0, f32::MIN_POSITIVE, 3.0]
            .iter()
            .map(|x| x.to_bits())
            .collect::<Vec<_>>()
    );
    assert!(decode_output(&p[..p.len() - 1]).is_err());
}

#[test]
fn per_row_masks_round_trip_and_are_bounded() {
    let h = StepHeader {
        step: 4,
        embed: true,
        head: true,
        keep: false,
        stages: vec![0],
        batch: (0..3).map(|s| TokenPos { seq: s + 1, pos: 5 }).collect(),
        rows: vec![0, 1, 2],
        argmax: Some(vec![]),
        row_masks: vec![vec![2], vec![], vec![2, 7]],
        rewind: vec![],
    };
    let data = u32_bytes(&[1, 2, 3]);
    let p = encode_step(&h, &data);
    let (h2, d2) = decode_step(&p).unwrap();
    assert_eq!(h2, h);
    assert_eq!(d2, &data[..]);
    for cut in 0..p.len() - data.len() {
        assert!(decode_step(&p[..cut]).is_err(), "cut at {cut}");
    }
    // the flag without an argmax is refused
    let mut bad = p.clone();
    bad[8] &= !FLAG_ARGMAX;
    assert!(decode_step(&bad).is_err());
    // the per-row lists share one bound with the common list
    let mut h = h;
    h.argmax = Some(vec![0; MAX_MASKED - 1]);
    h.row_masks = vec![vec![1], vec![2], vec![]];
    assert!(decode_step(&encode_step(&h, &data)).is_err());
    h.row_masks = vec![vec![1], vec![], vec![]];
    assert!(decode_step(&encode_step(&h, &data)).is_ok());
}

#[test]
fn argmax_step_round_trips_and_needs_the_head() {
    let mut h = StepHeader {
        step: 9,
        embed: true,
        head: true,
        keep: false,
        stages: vec![0],
        batch: vec![TokenPos { seq: 1, pos: 0 }],
        rows: vec![0],
        argmax: Some(vec![2, 49_152]),
        row_masks: vec![],
        rewind: vec![],
    };
    let data = u32_bytes(&[17]);
    let p = encode_step(&h, &data);
    let (h2, d2) = decode_step(&p).unwrap();
    assert_eq!(h2, h);
    assert_eq!(d2, &data[..]);
    for cut in 0..p.len() - data.len() {
        assert!(decode_step(&p[..cut]).is_err(), "cut at {cut}");
    }
    h.head = false;
    let e = decode_step(&encode_step(&h, &data)).unwrap_err();
    assert!(e.to_string().contains("without the head"), "{e}");
    // an absurd masked-id count is refused before anything is allocated
    h.head = true;
    h.argmax = Some(vec![]);
    let mut p = encode_step(&h, &[]);
    let n = p.len();
    p[n - 4..].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(decode_step(&p).is_err());

    let pairs = [(5u32, 1.25f32), (0, f32::NEG_INFINITY)];
    let out = OutputHeader {
        step: 9,
        kind: OutputKind::Argmax,
        rows: 2,
        cols: 2,
        times: JobTimes::default(),
    };
    let p = encode_output(&out, &argmax_bytes(&pairs));
    let (o2, d) = decode_output(&p).unwrap();
    assert_eq!(o2, out);
    assert_eq!(bytes_argmax(d).unwrap(), pairs);
    assert!(bytes_argmax(&d[..7]).is_err());
    let mut bad = p.clone();
    bad[8] = 3; // unknown kind
    assert!(decode_output(&bad).is_err());
}

#[test]
fn rewound_sequences_round_trip_and_are_checked() {
    let tp = |seq, pos| TokenPos { seq, pos };
    let mut h = StepHeader {
        step: 5,
        embed: true,
        head: true,
        keep: false,
        stages: vec![0],
        batch: vec![tp(4, 10), tp(4, 11), tp(4, 12), tp(9, 3)],
        rows: vec![0, 1, 2, 3],
        argmax: Some(vec![2]),
        row_masks: vec![],
        rewind: vec![4],
    };
    let data = u32_bytes(&[1, 2, 3, 4]);
    let p = encode_step(&h, &data);
    let (h2, d2) = decode_step(&p).unwrap();
    assert_eq!(h2, h);
    assert_eq!(d2, &data[..]);
    for cut in 0..p.len() - data.len() {
        assert!(decode_step(&p[..cut]).is_err(), "cut at {cut}");
    }
    // a sequence not in the step, or listed twice, is refused
    for bad in [vec![5], vec![4, 4], vec![4, 9, 4]] {
        h.rewind = bad.clone();
        let e = decode_step(&encode_step(&h, &data)).unwrap_err();
        assert!(e.to_string().contains("rewound"), "{bad:?}: {e}");
    }
    // more sequences than the step has: refused from the count, before reading them
    h.rewind = vec![4];
    let mut p = encode_step(&h, &[]);
    let at = p.len() - 12;
    p[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(decode_step(&p).is_err());
}
