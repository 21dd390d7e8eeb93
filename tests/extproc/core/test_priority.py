from extproc.core.priority import vllm_priority


def test_first_request_gets_the_tier_base_and_each_pending_one_adds_one() -> None:
    assert vllm_priority(10, 0) == 10
    assert vllm_priority(10, 3) == 13


def test_power_users_fourth_request_ranks_behind_anothers_first() -> None:
    power_user_fourth = vllm_priority(0, 3)
    other_first = vllm_priority(0, 0)
    assert other_first < power_user_fourth
