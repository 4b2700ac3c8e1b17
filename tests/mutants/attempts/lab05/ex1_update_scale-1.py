# origin: considered alternative
# what I believed: The growth rule is 'after growth_interval clean steps, grow'; a tracker that starts above the interval (5 with interval 4) has already passed it, so I thought >= is the robust test and the tracker then goes back to 0 with a growth.
# visible check said: AssertionError: scale=1.0, tracker=5, growth=2.0, backoff=0.5, interval=4, hysteresis 1: step 0: got (2.0, 0), torch gives (1.0, 6)
# grader said: 0/3: AssertionError: scale=1.0, tracker=5, growth=2.0, backoff=0.5, interval=4, hysteresis 1: step 0: got (2.0, 0), torch gives (1.0, 6) (check line 21)  [no misconception named]
# misconception: The rule grows only when the incremented tracker EQUALS growth_interval (as torch._amp_update_scale_ does); a tracker already above the interval keeps counting up and never grows, so >= is not the same rule.
def update_scale(scale, growth_tracker, hysteresis_left, found_inf, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, hysteresis=2, min_scale=1.0):
    f32 = lambda v: torch.tensor(v, dtype=torch.float32).item()
    if found_inf:
        growth_tracker = 0
        hysteresis_left -= 1
        if hysteresis_left <= 0:
            scale = max(f32(scale * backoff_factor), min_scale)
    else:
        growth_tracker += 1
        if growth_tracker >= growth_interval:
            growth_tracker = 0
            hysteresis_left = hysteresis
            grown = f32(scale * growth_factor)
            if not math.isinf(grown):
                scale = grown
    return scale, growth_tracker, hysteresis_left
