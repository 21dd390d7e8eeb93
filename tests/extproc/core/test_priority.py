from extproc.core.priority import UserOffsets, vllm_priority


def test_first_request_gets_the_tier_base_and_each_pending_one_adds_one() -> None:
    assert vllm_priority(10, 0) == 10
    assert vllm_priority(10, 3) == 13


def test_power_users_fourth_request_ranks_behind_anothers_first() -> None:
    power_user_fourth = vllm_priority(0, 3)
    other_first = vllm_priority(0, 0)
    assert other_first < power_user_fourth


def grant_next(users: UserOffsets, user: str) -> int:
    offset = users.next(user)
    users.granted(user, offset)
    return offset


def test_each_request_in_flight_pushes_the_users_next_one_back() -> None:
    users = UserOffsets()
    assert [grant_next(users, "power") for _ in range(4)] == [0, 1, 2, 3]
    assert users.next("casual") == 0
    assert users.in_flight("power") == 4


def test_a_users_next_request_never_overtakes_its_own_earlier_ones() -> None:
    users = UserOffsets()
    for _ in range(4):
        grant_next(users, "power")  # offsets 0, 1, 2, 3
    for offset in (0, 1, 2):  # the first three finish; the one at 3 may still be queued
        users.finished("power", offset)
    assert users.in_flight("power") == 1
    assert grant_next(users, "power") == 3  # ties with it (vLLM: arrival order), not 1
    users.finished("power", 3)
    assert users.next("power") == 3  # the one granted at 3 is still in flight
    users.finished("power", 3)
    assert users.next("power") == 0 and users.in_flight("power") == 0


def test_the_offset_falls_back_to_the_count_once_the_high_ones_finish() -> None:
    users = UserOffsets()
    for _ in range(3):
        grant_next(users, "u")  # 0, 1, 2
    users.finished("u", 2)
    users.finished("u", 1)
    assert users.next("u") == 1  # one in flight, at 0


def test_finishing_what_was_never_granted_changes_nothing() -> None:
    users = UserOffsets()
    grant_next(users, "u")
    users.finished("u", 5)
    users.finished("nobody", 0)
    assert users.in_flight("u") == 1 and users.next("u") == 1
